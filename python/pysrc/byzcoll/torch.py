"""PyTorch integration: a robust DistributedDataParallel communication hook, asynchronous robust
all-reduce returning a ``torch.futures.Future``, and joining byzcoll through an existing
``torch.distributed`` process group.

::

    import torch.distributed as dist, byzcoll.torch as bt
    dist.init_process_group("gloo")                     # as usual, under torchrun
    comm = bt.init_from_process_group()                 # byzcoll joins through it
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = bt.register_ddp_comm_hook(model, comm, "median", f=1)

Registration is collective (every rank registers, as every rank constructs DDP) and checks what
can be checked before training: the rule, its parameters and its precondition for this world
(one round on a vector of zeros), the gradients' dtype and device, and the bucket policy below.
A refusal is the byzcoll exception it will always be (:class:`byzcoll.PreconditionError`,
:class:`byzcoll.InvalidUsage`, ...). An error of a later round (:class:`byzcoll.TooManyFaults`,
say) is raised by ``loss.backward()`` with its byzcoll type once DDP has finished the backward
pass; the gradients of that step are then not aggregated (skip the step), and DDP goes on with
the next.

DDP hands the hook one gradient bucket at a time. Coordinate-wise rules (median, trimmed mean,
mean) aggregate each coordinate independently, so a per-bucket aggregate is the aggregate of the
whole gradient. Rules that compare whole vectors (Krum, Multi-Krum, Bulyan, geometric median,
centered clipping, NNM) are not: a per-bucket Krum is not Krum. For those the model's gradients
must fit in one bucket at every step. DDP reduces step 1 in one bucket and then re-buckets with
a first bucket of at most 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``) unless ``bucket_cap_mb``
is given, so :func:`register_ddp_comm_hook` refuses a whole-vector rule unless the gradients fit
under every cap, and names the ``bucket_cap_mb`` to construct DDP with.

FSDP2 (``fully_shard``) reduce-scatters each parameter group's gradients instead;
:func:`fsdp_robust_reduce_scatter` replaces that by byzcoll's robust reduce-scatter (each rank
gets the robust aggregate of its own shard, at about the traffic of the sharded all-reduce)::

    fully_shard(model)
    rs = bt.fsdp_robust_reduce_scatter(model, comm, "median", f=1)
    ...                                                 # rs.last_report after each backward

The same rule applies: a whole-vector rule needs the whole gradient in one reduce-scatter, so it
is refused on a model with more than one ``fully_shard`` group.

``torch.distributed`` and torchft: importing this module registers the backend ``"byzcoll"``
(:class:`ProcessGroupByzcoll`), so ``dist.init_process_group("byzcoll", ...)`` makes a process
group whose ``all_reduce`` with SUM, AVG, MIN or MAX is that plain reduction (never silently
robust) and whose ``robust_all_reduce`` is byzcoll's. It keeps torchft's process-group contract
(``configure(store_addr, replica_id, rank, world_size, ...)`` joins a fresh communicator at each
quorum change), so torchft's ``Manager`` decides the membership: a rank that dies is left out of
the next quorum, and one that restarts is let in and fetches the model state from a healthy
replica (torchft's checkpoint transport)::

    pg = bt.ProcessGroupByzcoll()
    manager = torchft.Manager(pg=pg, min_replica_size=2, ...)
    ...                                                 # each step:
    manager.start_quorum()
    loss.backward()
    pg.robust_all_reduce(flat_grads, "median", f=1)     # the robust step, on this quorum
    if manager.should_commit():
        opt.step()

``examples/python/torchft_train.py`` trains this way with a replica killed and restarted.

Tensors are float32, float64, float16 or bfloat16 (the 16-bit ones travel as two bytes per
element; sums and distances are taken in f64 and rounded once), on the CPU or on a CUDA device.
A CUDA tensor (a CUDA model's DDP bucket or FSDP2 gradient, say) goes device to device over
NCCL (``BYZCOLL_TRANSPORT=nccl``) when the rule has CUDA kernels (median, trimmed mean, Krum,
Multi-Krum, Bulyan) and the dtype is float32, bfloat16 or float16: no host copy, after the work
queued on its stream. Otherwise it is staged through pinned host memory, one blocking copy each
way per call, after the work queued on its stream; its result is written back before the call
(or the future) completes (the report's ``staged_bytes``). Other dtypes and devices are refused
with :class:`byzcoll.InvalidUsage`.
"""

import math

import torch
import torch.distributed as dist

from . import (
    Communicator,
    InvalidUsage,
    UnsupportedError,
    _goes_device_to_device,
    _lent,
    _noted,
    _own_shard,
    _Staged,
    init_with_allgather,
)
from ._process_group import ProcessGroupByzcoll, register as _register_backend

try:  # FSDP2's custom-collective interface (PyTorch >= 2.8), not re-exported publicly
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - older PyTorch
    _ReduceScatter = object

__all__ = [
    "COORDINATE_WISE",
    "HookState",
    "ProcessGroupByzcoll",
    "RobustReduceScatter",
    "ddp_comm_hook",
    "fsdp_robust_reduce_scatter",
    "init_from_process_group",
    "register_ddp_comm_hook",
    "robust_all_reduce_async",
]

_register_backend()

#: Rules whose aggregate of a slice is the slice of the aggregate.
COORDINATE_WISE = frozenset({"median", "trimmed-mean", "trimmed_mean", "mean"})


def _start(comm: Communicator, tensor, rule, f, kwargs, on_report):
    """Starts ``comm.robust_all_reduce(tensor, rule, f, **kwargs)`` after the calls made on
    `comm` before it (the communicator's own queue, in Rust: no thread of ours) and returns a
    ``torch.futures.Future`` that completes with ``on_report(report)``, or with the exception.
    A CUDA tensor goes device to device over NCCL where the rule has CUDA kernels (the work
    queued on its stream is waited for now, and the result is on the device when the future
    completes); any other CUDA tensor is staged through pinned host memory, its result copied
    back before the future completes."""
    fut = torch.futures.Future()
    staged = None

    def done(report, error):
        if error is not None:
            fut.set_exception(error)
            return
        try:
            if staged is not None:
                staged.write_back()
                report = _noted(report, staged)
            fut.set_result(on_report(report))
        except BaseException as e:  # the future carries it to the waiter
            fut.set_exception(e)

    try:
        if _goes_device_to_device(comm._inner, tensor, rule):
            # The callback holds `tensor`, and so its memory, until the call has run.
            comm._inner._start_robust_all_reduce_device(
                *_lent(tensor), rule, f, lambda report, error, _kept=tensor: done(report, error), **kwargs
            )
        else:
            staged = _Staged(tensor)
            comm._inner._start_robust_all_reduce(staged.array, rule, f, done, **kwargs)
    except BaseException as e:  # refused before it started: the future says so
        fut.set_exception(e)
    return fut


def robust_all_reduce_async(comm: Communicator, tensor, rule, f, **kwargs):
    """Starts ``comm.robust_all_reduce(tensor, rule, f, **kwargs)`` and returns a
    ``torch.futures.Future`` that completes with ``tensor`` (aggregated in place) or with the
    exception. Calls on one communicator run in the order they were made, with the GIL released
    while the ranks talk, so the caller can overlap them with computation."""
    return _start(comm, tensor, rule, f, kwargs, lambda report: tensor)


def init_from_process_group(group=None, *, listen=None, timeout_ms=None) -> Communicator:
    """Joins byzcoll through ``torch.distributed``'s all_gather_object on ``group`` (default:
    the world): no store port and no secret to export; connects over TCP."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)

    def allgather(record):
        out = [None] * size
        dist.all_gather_object(out, bytes(record), group=group)
        return out

    return init_with_allgather(rank, size, allgather, listen=listen, timeout_ms=timeout_ms)


class HookState:
    """What :func:`ddp_comm_hook` aggregates with: the communicator, the rule (no default) and
    its parameters (``f``, ``policy``, ``replicas``, ``m``, ``tau``). :func:`register_ddp_comm_hook`
    makes one after checking them; ``last_report`` holds the report of the latest bucket."""

    def __init__(self, comm: Communicator, rule, f, *, policy="gather", replicas=None, m=None, tau=None):
        self.comm = comm
        self.rule = rule
        self.kwargs = dict(policy=policy, replicas=replicas, m=m, tau=tau)
        self.f = f
        self.last_report = None


def _coordinate_wise_rules():
    return ", ".join(sorted(COORDINATE_WISE))


def _raise_after_backward(failed):
    """Has the autograd engine raise ``failed[0]``, if there is one by then, once the backward
    pass is finished: DDP's finalization and FSDP's root post-backward are final callbacks of
    the engine, queued before this one runs, and the check is queued from a callback queued
    now, so it runs after them. DDP or FSDP thus finishes the step (and can run the next)
    before the error is raised, and the error keeps its type: DDP reads the hook's future as a
    tensor in C++, so an exception set on it (``Future.set_exception``) would reach the user as
    ``Unable to cast ... to Tensor``, and one raised in a ``then`` callback as a
    ``RuntimeError``.

    Raises ``RuntimeError`` outside a backward pass (DDP's ``join`` runs hooks there)."""
    engine = torch.autograd.Variable._execution_engine

    def check():
        if failed:
            raise failed[0]

    engine.queue_callback(lambda: engine.queue_callback(check))


def _value(fut):
    return fut.value()


def ddp_comm_hook(state: HookState, bucket):
    """A ``DistributedDataParallel.register_comm_hook`` hook (register it with
    :func:`register_ddp_comm_hook`): replaces each gradient bucket by its robust aggregate over
    the ranks (which, like DDP's averaged all-reduce, estimates the mean gradient). Refuses a
    whole-vector rule on a model split into several buckets.

    A round's byzcoll exception is raised by ``backward()`` with its type once DDP has finished
    the backward pass (the bucket then holds no aggregate: skip the step); outside a backward
    pass, as in DDP's ``join``, the returned future fails with a ``RuntimeError`` that names
    it."""
    if state.rule not in COORDINATE_WISE and not (bucket.index() == 0 and bucket.is_last()):
        raise InvalidUsage(
            f"rule {state.rule!r} compares whole gradients, and DDP split this model into several "
            "buckets: a per-bucket aggregate would not be that rule. Register the hook with "
            "byzcoll.torch.register_ddp_comm_hook(ddp, ...), which checks DDP's bucket caps before "
            "training and names the bucket_cap_mb to construct DistributedDataParallel with, or use "
            f"a coordinate-wise rule ({_coordinate_wise_rules()})"
        )
    buf = bucket.buffer()

    def keep(report):
        state.last_report = report
        return buf

    done = _start(state.comm, buf, state.rule, state.f, state.kwargs, keep)
    failed = []
    try:
        _raise_after_backward(failed)
    except RuntimeError:  # not in a backward pass
        return done.then(_value)

    def settle(fut):
        try:
            return fut.value()
        except Exception as e:  # raised by the engine after DDP's finalization
            failed.append(e)
            return buf

    return done.then(settle)


def _reduced_parameters(ddp):
    """The parameters whose gradients DDP reduces: trainable, not ignored, each once."""
    ignored = getattr(ddp, "parameters_to_ignore", ())
    return [p for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored]


def _first_bucket_cap(ddp):
    """The fewest gradient bytes a DDP bucket may close at, once DDP re-buckets after step 1,
    and what set it. The first bucket's cap is 1 MiB when ``bucket_cap_mb`` was not given."""
    cap, why = ddp.bucket_bytes_cap, f"bucket_cap_mb={ddp.bucket_bytes_cap / 2**20:g}"
    if getattr(ddp, "bucket_bytes_cap_default", False) and dist._DEFAULT_FIRST_BUCKET_BYTES < cap:
        cap = dist._DEFAULT_FIRST_BUCKET_BYTES
        why = f"DDP's first bucket without bucket_cap_mb: {cap} bytes"
    for c in getattr(ddp, "bucket_bytes_cap_list", None) or ():
        if c < cap:
            cap, why = c, f"bucket_cap_mb_list={[b / 2**20 for b in ddp.bucket_bytes_cap_list]}"
    return cap, why


def _check_one_bucket(ddp, rule):
    """Refuses a whole-vector rule unless DDP reduces every step's gradients in one bucket."""
    params = _reduced_parameters(ddp)
    kinds = sorted({f"{p.dtype} on {p.device}" for p in params})
    if len(kinds) > 1:
        raise InvalidUsage(
            f"rule {rule!r} compares whole gradients, and this model's parameters are of "
            f"{len(kinds)} kinds ({', '.join(kinds)}), which DDP reduces in separate buckets: "
            "make them one dtype on one device, or use a coordinate-wise rule "
            f"({_coordinate_wise_rules()})"
        )
    total = sum(p.numel() * p.element_size() for p in params)
    cap, why = _first_bucket_cap(ddp)
    if total > cap:
        raise InvalidUsage(
            f"rule {rule!r} compares whole gradients, so DDP must reduce all of this model's "
            f"gradients ({total} bytes) in one bucket at every step; after step 1 DDP re-buckets "
            f"them in the order they are computed, closing a bucket once it holds {cap} bytes "
            f"({why}), which can split them. Construct DistributedDataParallel(..., "
            f"bucket_cap_mb={math.ceil(total / 2**20)}), or use a coordinate-wise rule "
            f"({_coordinate_wise_rules()})"
        )


def _check_rule(run, tensors):
    """Checks a rule, its parameters and its precondition for the world by running it once,
    collectively, on zeros of each dtype and device in `tensors` (in the same order on every
    rank): the checks of the rounds to come, raising the same typed errors, before training."""
    for dtype, device in sorted({(t.dtype, t.device) for t in tensors}, key=str):
        run(dtype, device)


def register_ddp_comm_hook(
    ddp, comm: Communicator, rule, f, *, policy="gather", replicas=None, m=None, tau=None, hook=ddp_comm_hook
) -> HookState:
    """Registers :func:`ddp_comm_hook` (or `hook`, a function that calls it) on the
    ``DistributedDataParallel`` module `ddp`, aggregating with `rule` tolerating `f` Byzantine
    ranks (and ``policy``, ``replicas``, ``m``, ``tau`` as in
    :meth:`byzcoll.Communicator.robust_all_reduce`); returns the :class:`HookState`, whose
    ``last_report`` is the latest bucket's report. Every rank calls it, as every rank constructs
    DDP: it runs one robust round on a vector of zeros of each gradient dtype.

    Refuses, before training, what the rounds would refuse: an unknown rule or invalid parameters
    (:class:`byzcoll.InvalidUsage`), a precondition the world does not meet, such as Krum's
    n > 2f + 2 (:class:`byzcoll.PreconditionError`), gradients that are not float32, float64, float16
    or bfloat16 tensors on the CPU or a CUDA device (:class:`byzcoll.InvalidUsage`), and a
    whole-vector rule (not in
    :data:`COORDINATE_WISE`) on a model whose gradients DDP would split into several buckets at
    some step (:class:`byzcoll.InvalidUsage` naming the ``bucket_cap_mb`` to pass)."""
    state = HookState(comm, rule, f, policy=policy, replicas=replicas, m=m, tau=tau)
    if rule not in COORDINATE_WISE:
        _check_one_bucket(ddp, rule)
    _check_rule(
        lambda dtype, device: comm.robust_all_reduce(
            torch.zeros(comm.size, dtype=dtype, device=device), rule, f, **state.kwargs
        ),
        _reduced_parameters(ddp),
    )
    ddp.register_comm_hook(state, hook)
    return state


class RobustReduceScatter(_ReduceScatter):
    """An FSDP2 ``ReduceScatter`` (``FSDPModule.set_custom_reduce_scatter``) backed by
    :meth:`byzcoll.Communicator.robust_reduce_scatter`: the gradient shard FSDP gives each rank is
    the robust aggregate (``rule`` tolerating ``f`` Byzantine ranks) of every rank's gradients for
    that shard. FSDP's ``AVG`` gets the aggregate itself, ``SUM`` the aggregate times the world
    size (so FSDP's own division still gives the aggregate); other ops are refused. The group
    must be the communicator's ranks in the same order. ``last_report`` holds the report of the
    latest call. A round's byzcoll exception is raised by ``backward()`` with its type once FSDP
    has finished the backward pass, the shard then holding this rank's own gradient (skip the
    step)."""

    def __init__(self, comm: Communicator, rule, f, *, replicas=None, m=None, tau=None):
        self.comm = comm
        self.rule = rule
        self.f = f
        self.kwargs = dict(replicas=replicas, m=m, tau=tau)
        self.last_report = None

    def allocate(self, size, *, dtype, device):
        """A plain tensor on FSDP's device: byzcoll reads and writes it in place (host memory), device
        to device over NCCL, or staged through pinned host memory."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if async_op:
            raise InvalidUsage("RobustReduceScatter runs synchronously (async_op=False)")
        if group is not None and (
            dist.get_world_size(group) != self.comm.size or dist.get_rank(group) != self.comm.rank
        ):
            raise InvalidUsage(
                f"FSDP reduce-scatters over a group of {dist.get_world_size(group)} ranks (this one "
                f"{dist.get_rank(group)}), the communicator is {self.comm!r}: join byzcoll through "
                "the same group (init_from_process_group(group))"
            )
        if op == dist.ReduceOp.AVG:
            scale = None
        elif op == dist.ReduceOp.SUM:
            scale = float(self.comm.size)
        else:
            raise InvalidUsage(
                f"FSDP asked for a {op} reduce-scatter: a robust aggregate stands for AVG (or SUM "
                "with FSDP's own division); leave set_gradient_divide_factor at its default"
            )
        try:
            self.last_report = self.comm.robust_reduce_scatter(
                input_tensor, output_tensor, self.rule, self.f, **self.kwargs
            )
        except Exception as e:
            try:
                _raise_after_backward([e])
            except RuntimeError:  # not in a backward pass
                raise e from None
            output_tensor.copy_(_own_shard(input_tensor, self.comm.rank, self.comm.size))
        if scale is not None:
            output_tensor.mul_(scale)
        return None


def fsdp_robust_reduce_scatter(module, comm: Communicator, rule, f, *, replicas=None, m=None, tau=None):
    """Makes every ``fully_shard`` group in ``module`` reduce-scatter its gradients through one
    :class:`RobustReduceScatter` (returned, with its ``last_report``). Every rank calls it: it
    runs one robust reduce-scatter of zeros per parameter dtype, so that what the rounds would
    refuse (unknown rule, invalid parameters, a precondition the world does not meet, a dtype
    other than float32, float64, float16 and bfloat16) is refused here, with the same typed error. Refuses a
    whole-vector rule (Krum family, geometric median, centered clipping, NNM) when ``module``
    holds more than one group: each group's reduce-scatter sees only its own parameters'
    gradients. A round's error is raised by ``backward()`` with its byzcoll type."""
    from torch.distributed.fsdp import FSDPModule

    if _ReduceScatter is object or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise UnsupportedError(
            f"PyTorch {torch.__version__} has no FSDPModule.set_custom_reduce_scatter (2.8 or newer)"
        )
    groups = [m_ for m_ in module.modules() if isinstance(m_, FSDPModule)]
    if not groups:
        raise InvalidUsage("no fully_shard module in it: call fully_shard(module) first")
    if rule not in COORDINATE_WISE and len(groups) > 1:
        raise InvalidUsage(
            f"rule {rule!r} compares whole gradients, and this model has {len(groups)} fully_shard "
            "groups, each reduce-scattered on its own: a per-group aggregate would not be that rule. "
            f"Shard the model as one group, or use a coordinate-wise rule ({', '.join(sorted(COORDINATE_WISE))})"
        )
    rs = RobustReduceScatter(comm, rule, f, replicas=replicas, m=m, tau=tau)
    _check_rule(
        lambda dtype, device: comm.robust_reduce_scatter(
            torch.zeros(comm.size, dtype=dtype, device=device),
            torch.zeros(1, dtype=dtype, device=device),
            rule,
            f,
            **rs.kwargs,
        ),
        [p for p in module.parameters() if p.requires_grad],
    )
    for g in groups:
        g.set_custom_reduce_scatter(rs)
    return rs
