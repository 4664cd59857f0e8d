"""PyTorch integration: a robust DistributedDataParallel communication hook, asynchronous robust
all-reduce returning a ``torch.futures.Future``, and joining byzcoll through an existing
``torch.distributed`` process group.

::

    import torch.distributed as dist, byzcoll.torch as bt
    dist.init_process_group("gloo")                     # as usual, under torchrun
    comm = bt.init_from_process_group()                 # byzcoll joins through it
    model = torch.nn.parallel.DistributedDataParallel(net)
    model.register_comm_hook(bt.HookState(comm, "median", f=1), bt.ddp_comm_hook)

DDP hands the hook one gradient bucket at a time. Coordinate-wise rules (median, trimmed mean,
mean) aggregate each coordinate independently, so a per-bucket aggregate is the aggregate of the
whole gradient. Rules that compare whole vectors (Krum, Multi-Krum, Bulyan, geometric median,
centered clipping, NNM) are not: a per-bucket Krum is not Krum. For those the hook requires the
whole gradient in one bucket (``DistributedDataParallel(..., bucket_cap_mb=...)`` larger than the
model) and refuses otherwise.

FSDP2 (``fully_shard``) reduce-scatters each parameter group's gradients instead;
:func:`fsdp_robust_reduce_scatter` replaces that by byzcoll's robust reduce-scatter (each rank
gets the robust aggregate of its own shard, at about the traffic of the sharded all-reduce)::

    fully_shard(model)
    rs = bt.fsdp_robust_reduce_scatter(model, comm, "median", f=1)
    ...                                                 # rs.last_report after each backward

The same rule applies: a whole-vector rule needs the whole gradient in one reduce-scatter, so it
is refused on a model with more than one ``fully_shard`` group.
"""

import queue
import threading

import torch
import torch.distributed as dist

from . import Communicator, InvalidUsage, UnsupportedError, init_with_allgather

try:  # FSDP2's custom-collective interface (PyTorch >= 2.8), not re-exported publicly
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - older PyTorch
    _ReduceScatter = object

__all__ = [
    "COORDINATE_WISE",
    "HookState",
    "RobustReduceScatter",
    "ddp_comm_hook",
    "fsdp_robust_reduce_scatter",
    "init_from_process_group",
    "robust_all_reduce_async",
]

#: Rules whose aggregate of a slice is the slice of the aggregate.
COORDINATE_WISE = frozenset({"median", "trimmed-mean", "trimmed_mean", "mean"})


class _Worker:
    """One thread per communicator that runs its collectives in submission order, so every rank
    issues them in the same order (two concurrent calls would be ordered arbitrarily)."""

    def __init__(self):
        self._jobs = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="byzcoll-async", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            job, fut = self._jobs.get()
            try:
                fut.set_result(job())
            except BaseException as e:  # the future carries it to the waiter
                fut.set_exception(e)

    def submit(self, job):
        fut = torch.futures.Future()
        self._jobs.put((job, fut))
        return fut


_workers = {}
_workers_lock = threading.Lock()


def _worker(comm):
    with _workers_lock:
        w = _workers.get(id(comm))
        if w is None:
            w = _workers[id(comm)] = _Worker()
        return w


def robust_all_reduce_async(comm: Communicator, tensor, rule, f, **kwargs):
    """Starts ``comm.robust_all_reduce(tensor, rule, f, **kwargs)`` and returns a
    ``torch.futures.Future`` that completes with ``tensor`` (aggregated in place) or with the
    exception. Calls on one communicator run in the order they were made, with the GIL released
    while the ranks talk, so the caller can overlap them with computation."""

    def job():
        comm.robust_all_reduce(tensor, rule, f, **kwargs)
        return tensor

    return _worker(comm).submit(job)


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
    its parameters (``f``, ``policy``, ``replicas``, ``m``, ``tau``)."""

    def __init__(self, comm: Communicator, rule, f, *, policy="gather", replicas=None, m=None, tau=None):
        self.comm = comm
        self.rule = rule
        self.kwargs = dict(policy=policy, replicas=replicas, m=m, tau=tau)
        self.f = f
        self.last_report = None


def ddp_comm_hook(state: HookState, bucket):
    """A ``DistributedDataParallel.register_comm_hook`` hook: replaces each gradient bucket by
    its robust aggregate over the ranks (which, like DDP's averaged all-reduce, estimates the mean
    gradient). Refuses a whole-vector rule on a model split into several buckets."""
    if state.rule not in COORDINATE_WISE and not (bucket.index() == 0 and bucket.is_last()):
        raise InvalidUsage(
            f"rule {state.rule!r} compares whole gradients, and DDP split this model into several "
            "buckets: a per-bucket aggregate would not be that rule. Construct "
            "DistributedDataParallel with a bucket_cap_mb larger than the model, or use a "
            f"coordinate-wise rule ({', '.join(sorted(COORDINATE_WISE))})"
        )
    buf = bucket.buffer()

    def job():
        state.last_report = state.comm.robust_all_reduce(buf, state.rule, state.f, **state.kwargs)
        return buf

    return _worker(state.comm).submit(job)


class RobustReduceScatter(_ReduceScatter):
    """An FSDP2 ``ReduceScatter`` (``FSDPModule.set_custom_reduce_scatter``) backed by
    :meth:`byzcoll.Communicator.robust_reduce_scatter`: the gradient shard FSDP gives each rank is
    the robust aggregate (``rule`` tolerating ``f`` Byzantine ranks) of every rank's gradients for
    that shard. FSDP's ``AVG`` gets the aggregate itself, ``SUM`` the aggregate times the world
    size (so FSDP's own division still gives the aggregate); other ops are refused. The group
    must be the communicator's ranks in the same order. ``last_report`` holds the report of the
    latest call."""

    def __init__(self, comm: Communicator, rule, f, *, replicas=None, m=None, tau=None):
        self.comm = comm
        self.rule = rule
        self.f = f
        self.kwargs = dict(replicas=replicas, m=m, tau=tau)
        self.last_report = None

    def allocate(self, size, *, dtype, device):
        """A plain tensor: byzcoll reads and writes host memory in place."""
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
        self.last_report = self.comm.robust_reduce_scatter(
            input_tensor, output_tensor, self.rule, self.f, **self.kwargs
        )
        if scale is not None:
            output_tensor.mul_(scale)
        return None


def fsdp_robust_reduce_scatter(module, comm: Communicator, rule, f, *, replicas=None, m=None, tau=None):
    """Makes every ``fully_shard`` group in ``module`` reduce-scatter its gradients through one
    :class:`RobustReduceScatter` (returned, with its ``last_report``). Refuses a whole-vector
    rule (Krum family, geometric median, centered clipping, NNM) when ``module`` holds more than
    one group: each group's reduce-scatter sees only its own parameters' gradients."""
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
    for g in groups:
        g.set_custom_reduce_scatter(rs)
    return rs
