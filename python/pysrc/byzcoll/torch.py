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
"""

import queue
import threading

import torch
import torch.distributed as dist

from . import Communicator, InvalidUsage, init_with_allgather

__all__ = [
    "COORDINATE_WISE",
    "HookState",
    "ddp_comm_hook",
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
