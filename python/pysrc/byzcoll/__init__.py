"""byzcoll: Byzantine-robust collective communication.

Every rank contributes a vector and every honest rank gets back a robust aggregate
(coordinate-wise median, trimmed mean, Krum, ...) even when some ranks send garbage, lie, crash
or stall::

    import numpy as np, byzcoll
    comm = byzcoll.init()                        # byzcoll launch, torchrun, mpirun, srun
    grad = np.full(1 << 20, comm.rank, dtype=np.float32)
    report = comm.robust_all_reduce(grad, rule="median", f=1)   # in place, zero copy
    print(report.faults)

There is no default rule. Arrays are numpy arrays (float32/float64, float16, C-contiguous,
writable) or torch CPU tensors, updated in place without a copy, or arrays of any library that
speaks DLPack (``__dlpack__``: CuPy, ...; read through torch, no copy; JAX's immutable arrays
are refused). CUDA tensors go
device to device over NCCL (``BYZCOLL_TRANSPORT=nccl``) where the rule has CUDA kernels;
elsewhere they are staged through pinned host memory (one blocking copy each way per call,
counted in the report's ``staged_bytes``; the result is written back only when the call
succeeds).
"""

import atexit
import os
import sys
import weakref

from . import _byzcoll
from ._byzcoll import (
    BootstrapError,
    DisagreementError,
    Error,
    ExcludedError,
    FellBehindError,
    InvalidUsage,
    OUTLYING_SCORE,
    PreconditionError,
    Report,
    TooManyFaults,
    TransportError,
    UnsupportedError,
    __version__,
    rules,
)

__all__ = [
    "BootstrapError",
    "Communicator",
    "DisagreementError",
    "Error",
    "ExcludedError",
    "FellBehindError",
    "InvalidUsage",
    "OUTLYING_SCORE",
    "PreconditionError",
    "Report",
    "TooManyFaults",
    "TransportError",
    "UnsupportedError",
    "__version__",
    "init",
    "init_mpi4py",
    "init_with_allgather",
    "rules",
]


class _BFloat16:
    """A torch bfloat16 CPU tensor's data as the extension reads it: the ``__array_interface__``
    of its 16-bit words with the type ``bfloat16`` (numpy has no bfloat16, and no numpy array
    says it, so an int16 array is never taken for one). Holds the view, and so the tensor."""

    def __init__(self, words):
        self._words = words
        self.__array_interface__ = dict(words.__array_interface__, typestr="bfloat16")


def _array(x):
    """The numpy view of `x` (itself for numpy arrays; a zero-copy view of a torch CPU tensor;
    a :class:`_BFloat16` over the words of a bfloat16 one)."""
    module = type(x).__module__
    if module.startswith("torch"):
        if x.device.type != "cpu":
            raise InvalidUsage(
                f"tensor on {x.device}: byzcoll takes CPU tensors, and CUDA tensors through "
                "its calls (staged through pinned host memory), not this device"
            )
        if not x.is_contiguous():
            raise InvalidUsage("the tensor is not contiguous: pass x.contiguous() and copy the result back")
        import torch

        if x.dtype == torch.bfloat16:
            return _BFloat16(x.detach().view(torch.int16).numpy())
        try:
            return x.detach().numpy()
        except TypeError:  # a dtype numpy has no counterpart for (float8, ...)
            raise InvalidUsage(
                f"dtype {x.dtype}: byzcoll takes float32, float64, float16 or bfloat16 tensors"
            ) from None
    return x


#: The CUDA rules' element types, by torch's name for them.
_DEVICE_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def _is_cuda(x):
    """Whether `x` is a torch tensor in CUDA device memory."""
    return type(x).__module__.startswith("torch") and x.device.type == "cuda"


def _from_dlpack(x):
    """`x` itself, or for an array of another library that speaks DLPack (``__dlpack__``: CuPy,
    ...) a torch tensor over the same memory, host or CUDA (``torch.from_dlpack``, no copy), so
    that a call writes its result into the caller's array. JAX arrays are refused: they are
    immutable, and a result written into one would break JAX's own assumptions."""
    if hasattr(x, "__array_interface__") or type(x).__module__.startswith(("numpy", "torch")):
        return x
    if not hasattr(x, "__dlpack__"):
        return x  # the extension refuses it, saying what it takes
    if type(x).__module__.startswith(("jax", "jaxlib")):
        raise InvalidUsage(
            "JAX arrays are immutable, and byzcoll writes its result in place: pass a numpy copy "
            "(numpy.array(x)) and read the result from it"
        )
    try:
        import torch
    except ImportError:
        raise InvalidUsage(
            f"{type(x).__name__} arrays are taken through DLPack, which byzcoll reads with torch: "
            "install torch, or pass a numpy array"
        ) from None
    return torch.from_dlpack(x)


def _goes_device_to_device(inner, x, rule):
    """Whether the CUDA tensor `x` goes device to device, aggregated by `rule`'s CUDA kernels:
    over NCCL's own transport, by a rule with kernels, float32, bfloat16 or float16, not empty."""
    return (
        _is_cuda(x)
        and x.numel() > 0
        and _DEVICE_DTYPES.get(str(x.dtype)) is not None
        and inner._device_to_device(rule)
    )


def _lent(x):
    """What the device entry points take of the CUDA tensor `x`: its data pointer, element
    count, dtype name and current stream; refuses a tensor that is not contiguous or that
    requires grad (it would be written in place behind autograd)."""
    import torch

    if not x.is_contiguous():
        raise InvalidUsage("the tensor is not contiguous: pass x.contiguous() and copy the result back")
    if x.requires_grad:
        raise InvalidUsage(
            "the tensor requires grad and would be written in place behind autograd: pass "
            "x.detach() (a gradient, as the DDP hook hands over, does not require grad)"
        )
    stream = torch.cuda.current_stream(x.device).cuda_stream
    return x.data_ptr(), x.numel(), _DEVICE_DTYPES[str(x.dtype)], stream


def _own_shard(tensor, rank, size):
    """This rank's shard of the torch tensor `tensor` (a view), cut as robust_reduce_scatter
    cuts it."""
    base, extra = divmod(tensor.numel(), size)
    start = rank * base + min(rank, extra)
    return tensor.reshape(-1)[start : start + base + (rank < extra)]


class _Staged:
    """`x` as the host side sees it: :attr:`array`, the numpy view of `x` itself, or for a CUDA
    tensor of a pinned host copy made once the work queued on the tensor's stream is done
    (the copy blocks until then; not made for an output, ``read=False``). :meth:`write_back` copies a result from the host copy into
    the CUDA tensor (blocking); nothing to do for host memory. The host copy lives as long as
    this object."""

    def __init__(self, x, read=True):
        self._device, self._host = None, None
        #: Bytes copied between the device and the host copy so far (both ways added).
        self.copied = 0
        if _is_cuda(x):
            import torch

            if not x.is_contiguous():
                raise InvalidUsage("the tensor is not contiguous: pass x.contiguous() and copy the result back")
            self._device = x
            self._host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
            if read:
                self._host.copy_(x)
                self.copied += self._host.nbytes
            x = self._host
        self.array = _array(x)

    def write_back(self):
        if self._device is not None:
            self._device.copy_(self._host)
            self.copied += self._host.nbytes


def _noted(report, *staged):
    """`report` with the bytes `staged` copied counted in its ``staged_bytes``."""
    copied = sum(s.copied for s in staged)
    if copied:
        report._note_staged(copied)
    return report


class Communicator:
    """One rank's membership in a job: robust and plain collectives on numpy arrays and torch
    CPU tensors. Create it with :func:`init`, :func:`init_mpi4py` or :func:`init_with_allgather`."""

    def __init__(self, inner):
        self._inner = inner
        # Closed at exit if the program did not (as mpi4py finalizes MPI): the close is
        # collective, and a rank left behind by a round that went on without it needs the
        # others until it is done.
        _open[:] = [c for c in _open if c() is not None]
        _open.append(weakref.ref(self))

    @property
    def rank(self):
        """This process's rank."""
        return self._inner.rank

    @property
    def size(self):
        """The number of ranks."""
        return self._inner.size

    @property
    def transport(self):
        """The transport's name: "tcp", "ucx", "libfabric", "nccl" or "local"."""
        return self._inner.transport

    def robust_all_reduce(self, x, rule, f, *, policy="gather", replicas=None, m=None, tau=None):
        """Replaces `x` in place by the robust aggregate of every rank's `x` under `rule`
        ("median", "trimmed-mean", "krum", "multi-krum", "bulyan", "geometric-median",
        "centered-clipping", "mean", "nnm+RULE"; see :func:`rules`) tolerating `f` Byzantine
        ranks, with the "gather" or "sharded" policy (`replicas` owners per shard; default
        2f + 1), or "auto" (gather or sharded with 2f + 1 owners, chosen per call from the
        world size, the vector's bytes and the rule; the report's ``replicas`` says which ran,
        None for gather). The GIL is released while the ranks talk. Returns a :class:`Report`; raises
        :class:`TooManyFaults`, :class:`PreconditionError`, :class:`DisagreementError`, ...

        A CUDA tensor (float32, bfloat16, float16) goes device to device over NCCL
        (``BYZCOLL_TRANSPORT=nccl``, not a communicator split from one), aggregated by
        byzcoll's CUDA kernels ("median", "trimmed-mean", "krum", "multi-krum", "bulyan") after
        the work queued on the tensor's current stream, with no host copy; otherwise it is
        staged through pinned host memory (counted in the report's ``staged_bytes``).
        """
        x = _from_dlpack(x)
        if _goes_device_to_device(self._inner, x, rule):
            return self._inner._robust_all_reduce_device(
                *_lent(x), rule, f, policy=policy, replicas=replicas, m=m, tau=tau
            )
        staged = _Staged(x)
        report = self._inner.robust_all_reduce(
            staged.array, rule, f, policy=policy, replicas=replicas, m=m, tau=tau
        )
        staged.write_back()
        return _noted(report, staged)

    def robust_reduce_scatter(self, input, output, rule, f, *, replicas=None, m=None, tau=None):
        """Robust reduce-scatter: `input` (every rank's whole vector) is cut into :attr:`size`
        shards and `output` (this rank's shard in length: ``len(input) // size``, one more on the
        first ``len(input) % size`` ranks) becomes `rule` applied to every rank's shard number
        :attr:`rank`, tolerating `f` Byzantine ranks. Each shard is aggregated by `replicas`
        owners (default 2f + 1) and combined by the median of their versions, as in the sharded
        all-reduce: bitwise its shard of ``robust_all_reduce(..., policy="sharded")``. `output`
        is written in place; `input` is not modified. Returns a :class:`Report`.

        CUDA tensors over NCCL (as :meth:`robust_all_reduce` takes them device to device) run
        the device all-reduce in sharded mode on a device copy of `input` and keep this rank's
        shard: no host copy, at the traffic of the sharded all-reduce (each shard's result goes
        to every rank, not only to its own), aggregated by the CUDA kernels rather than the CPU
        rules, without stragglers, and the report is that all-reduce's. Every rank must
        pass its tensors on the same device type (the calls differ otherwise, and the ranks that
        differ are named out of step). Other CUDA tensors are staged through pinned host
        memory."""
        input, output = _from_dlpack(input), _from_dlpack(output)
        if _is_cuda(output) and _goes_device_to_device(self._inner, input, rule):
            return self._robust_reduce_scatter_device(input, output, rule, f, replicas, m, tau)
        source, target = _Staged(input), _Staged(output, read=False)
        report = self._inner.robust_reduce_scatter(
            source.array, target.array, rule, f, replicas=replicas, m=m, tau=tau
        )
        target.write_back()
        return _noted(report, source, target)

    def _robust_reduce_scatter_device(self, input, output, rule, f, replicas, m, tau):
        """:meth:`robust_reduce_scatter` of CUDA tensors over NCCL: the sharded device
        all-reduce of a copy of `input`, then this rank's shard of it into `output`. Refuses
        what the host reduce-scatter refuses that the all-reduce would take (agreement
        "enforce")."""
        if self._inner.agreement == "enforce":
            raise UnsupportedError(
                "Agreement::Enforce in a reduce-scatter: each rank takes a shard of its own, so "
                "there is no common result to agree on; reduce-scatter runs Agreement::Detect"
            )
        if input.dtype != output.dtype or input.device != output.device:
            raise InvalidUsage(
                f"input is {input.dtype} on {input.device}, output {output.dtype} on "
                f"{output.device}: a reduce-scatter takes one dtype on one device"
            )
        whole = input.detach().reshape(-1).clone()
        shard = _own_shard(whole, self.rank, self.size)
        if output.numel() != shard.numel():
            raise InvalidUsage(
                f"output holds {output.numel()} elements, this rank's shard of {whole.numel()} "
                f"over {self.size} ranks {shard.numel()}"
            )
        report = self._inner._robust_all_reduce_device(
            *_lent(whole), rule, f, policy="sharded", replicas=replicas, m=m, tau=tau
        )
        output.copy_(shard.reshape(output.shape))
        return report

    def all_reduce(self, x, op="sum"):
        """Non-robust all-reduce in place ("sum", "min", "max"): one faulty rank corrupts every
        result. For comparison with :meth:`robust_all_reduce`."""
        staged = _Staged(_from_dlpack(x))
        self._inner.all_reduce(staged.array, op)
        staged.write_back()

    def set_stragglers(self, stragglers):
        """How many inputs a robust round (gather policy) may go without for their lateness
        alone: ``"auto"`` (the largest the rule allows with `f` Byzantine inputs among the rest;
        none under agreement ``"off"``), a count, 0 (wait for every input until the deadline),
        or ``"default"`` (the same as ``"auto"``, the default). Every
        rank must choose alike. Late inputs are faults of kind ``"late"`` in the report, and no
        rank sets the pace of the others."""
        self._inner.set_stragglers(stragglers)

    def set_step(self, step):
        """Sets the step id every later collective call carries in its fingerprint (``None``:
        no step id), e.g. the training step. Every call carries a fingerprint of what the caller
        asked for (operation, length, dtype, rule and parameters, policy) and of this step id;
        a rank whose call does not match is a fault of kind ``"out-of-step"`` at the ranks that
        receive from it (a robust call leaves it out), never a message of another call taken as
        this one's. Without a step id, a rank that skips a call and makes the next one with the
        same arguments is matched by count."""
        self._inner.set_step(step)

    def health(self):
        """What this rank has seen of each other rank in its robust rounds, in rank order: dicts
        with ``rank``, ``streak`` (None, or ``(symptom, rounds)``: ``"late"``, ``"missing"``,
        ``"malformed"`` or ``"disagreeing"`` in each of the last ``rounds`` rounds) and the
        counts ``late``, ``missing``, ``malformed``, ``disagreeing``. This rank's own
        observations only: evidence, not an accusation."""
        return self._inner.health()

    def shrink(self):
        """Shrinks the communicator to the ranks that are alive (every live rank calls it), like
        ``MPI_Comm_shrink``: the live ranks agree, tolerating ``f = (n - 1) // 3`` Byzantine
        ranks, on which ranks to keep, and each gets a new :class:`Communicator` of them,
        renumbered in their old order. A rank the others did not keep gets
        :class:`ExcludedError` (``kept`` lists the ranks kept)."""
        return Communicator(self._inner.shrink())

    def admit(self):
        """Admits the restarted ranks that knocked: a process started with ``BYZCOLL_REJOIN=1``
        (``byzcoll launch --restarts N`` starts a failed rank again that way) knocks in
        :func:`init` and waits. Every member calls this at the same point of its calls, a
        boundary of the application's choice; the members agree, tolerating ``f = (n - 1) // 3``
        Byzantine members, on whom to admit. Returns None when nobody knocked, else
        ``(communicator, admitted, epoch)``: a new :class:`Communicator` of the members and the
        admitted job ranks in job-rank order (:attr:`job_ranks`), at the new :attr:`epoch`.
        This communicator stays usable. The admitted rank's state (the model, the step) is the
        application's to hand over, e.g. by a broadcast from a member."""
        admitted = self._inner.admit()
        if admitted is None:
            return None
        inner, ranks, epoch = admitted
        return Communicator(inner), ranks, epoch

    @property
    def job_ranks(self):
        """Each rank's rank in the job, in this communicator's rank order: ``range(n)`` at the
        start; a shrink keeps its members', an admit gives the members' and the admitted ranks'."""
        return self._inner.job_ranks

    @property
    def epoch(self):
        """The job's membership epoch: 0 at the start, one more for each admit that admitted a
        rank."""
        return self._inner.epoch

    def barrier(self):
        """Blocks until every rank has entered the barrier."""
        self._inner.barrier()

    def close(self):
        """Closes the connections, collectively: where a round went on without a late rank,
        first waits (up to the step timeout) for every live rank to reach its close, so that a
        rank left behind still gets what it needs. Later calls raise :class:`InvalidUsage`."""
        self._inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return repr(self._inner)


# The communicators made so far (weakly): those still open at exit are closed then, the newest
# first.
_open = []


@atexit.register
def _close_at_exit():
    for ref in reversed(_open):
        comm = ref()
        if comm is not None:
            try:
                comm.close()
            except Error:
                pass


def _torch_holds_the_store():
    """Why MASTER_ADDR:MASTER_PORT, byzcoll's store address when BYZCOLL_STORE is not set, is
    torch's store and not byzcoll's (None when nothing says so): a torch.distributed process
    group of more than one rank (looked up only when torch is imported already), or torchrun's
    agent, which hosts its store there (TORCHELASTIC_USE_AGENT_STORE)."""
    if os.environ.get("BYZCOLL_STORE") or not os.environ.get("MASTER_PORT"):
        return None
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "torch.distributed's process group is initialized, and torch's store holds it"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" and os.environ.get("WORLD_SIZE") != "1":
        return "torchrun's agent hosts its store there"
    return None


def init():
    """Joins the job the launcher's environment describes (byzcoll launch, torchrun, mpirun,
    srun, or BYZCOLL_RANK / BYZCOLL_WORLD_SIZE / BYZCOLL_STORE / BYZCOLL_SECRET).

    Under torchrun, or once ``torch.distributed`` is initialized, MASTER_ADDR:MASTER_PORT is
    torch's store: without BYZCOLL_STORE, raises :class:`BootstrapError` at once, saying to join
    through torch with ``byzcoll.torch.init_from_process_group()`` (after
    ``torch.distributed.init_process_group``), or to give byzcoll a store of its own in
    BYZCOLL_STORE."""
    why = _torch_holds_the_store()
    if why is not None:
        raise BootstrapError(
            f"byzcoll.init() would host its rendezvous store at MASTER_ADDR:MASTER_PORT "
            f"({os.environ.get('MASTER_ADDR')}:{os.environ['MASTER_PORT']}), but {why}. Join "
            "through torch instead: torch.distributed.init_process_group(...) if not done yet, "
            "then comm = byzcoll.torch.init_from_process_group() (no store port and no secret "
            "to export); or set BYZCOLL_STORE to a free host:port for byzcoll's own store"
        )
    return Communicator(_byzcoll.init())


def init_with_allgather(rank, size, allgather, *, listen=None, timeout_ms=None):
    """Joins a `size`-rank job as `rank` through `allgather(record: bytes) -> list[bytes]`
    (every rank's record, in rank order). Connects over TCP on `listen` (an IP address; default
    BYZCOLL_TCP_ADDR, else this host name's address)."""
    return Communicator(
        _byzcoll.init_with_allgather(rank, size, allgather, listen=listen, timeout_ms=timeout_ms)
    )


def init_mpi4py(comm=None, *, listen=None, timeout_ms=None):
    """Joins the job of an mpi4py communicator (default ``MPI.COMM_WORLD``) through its
    allgather: no store port and no secret to export."""
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return init_with_allgather(
        comm.Get_rank(), comm.Get_size(), comm.allgather, listen=listen, timeout_ms=timeout_ms
    )
