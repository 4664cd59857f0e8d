"""byzcoll as a ``torch.distributed`` process group (backend ``"byzcoll"``) that keeps torchft's
process-group contract: :meth:`ProcessGroupByzcoll.configure` joins a fresh byzcoll
communicator through the store it is given, whenever torchft's quorum changes.

Re-exported by :mod:`byzcoll.torch`, which registers the backend when it is imported."""

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions, PrefixStore, ReduceOp, TCPStore

from . import Communicator, InvalidUsage, UnsupportedError, _Staged, init_with_allgather

BACKEND = "byzcoll"

#: How long a join waits for the other ranks' records in the store, unless the creator or
#: :meth:`ProcessGroupByzcoll.set_timeout` says otherwise.
DEFAULT_TIMEOUT = timedelta(seconds=60)

_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "sum", ReduceOp.MIN: "min", ReduceOp.MAX: "max"}


def _op_name(op):
    """byzcoll's name for a ``ReduceOp`` (AVG is a sum divided afterwards), or UnsupportedError."""
    for known, name in _OPS.items():
        if op == known:
            return name
    raise UnsupportedError(
        f"the byzcoll process group reduces with SUM, AVG, MIN or MAX, not {op}: a robust "
        "aggregate is reached through robust_all_reduce or the DDP comm hook, never through "
        "an allreduce op"
    )


def store_allgather(store, rank, size, timeout):
    """An all-gather over a ``torch.distributed`` store for byzcoll's join: each call sets this
    rank's record under its own key and waits for every rank's (keys numbered per call, so the
    join's two rounds do not mix). The store is trusted as torch trusts it: whoever can read it
    reads the job secret the join distributes."""
    calls = itertools.count()

    def allgather(record):
        n = next(calls)
        keys = [f"byzcoll/{n}/{r}" for r in range(size)]
        store.set(keys[rank], bytes(record))
        store.wait(keys, timeout)
        return [store.get(k) for k in keys]

    return allgather


def store_client(store_addr, timeout):
    """A client of the store at ``host:port/prefix`` (torchft's form; ``[v6]:port/prefix``
    too), under that prefix."""
    addr, _, prefix = store_addr.partition("/")
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InvalidUsage(f"store address {store_addr!r}: expected host:port/prefix")
    store = TCPStore(
        host_name=host.strip("[]"), port=int(port), is_master=False, wait_for_workers=False, timeout=timeout
    )
    return PrefixStore(prefix, store) if prefix else store


class _Work(dist._Work):
    """A collective started on the communicator's queue: ``wait()`` blocks until it has run
    and raises its byzcoll error; ``get_future()`` completes with the tensors or that error."""

    def __init__(self, future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None):
        self._future.wait()
        return True

    def get_future(self):
        return self._future


def _done(value):
    fut = torch.futures.Future()
    fut.set_result(value)
    return _Work(fut)


class ProcessGroupByzcoll(dist.ProcessGroup):
    """A ``torch.distributed`` process group over a byzcoll communicator.

    ``allreduce`` with ``ReduceOp.SUM``, ``AVG``, ``MIN`` or ``MAX`` is that plain reduction
    (byzcoll's non-robust all-reduce: never silently robust, and one faulty rank corrupts it,
    as with gloo); any other op raises :class:`byzcoll.UnsupportedError`, as do the collectives
    byzcoll does not offer (broadcast, all-gather, send, ...). The robust aggregate is an
    explicit call, :meth:`robust_all_reduce`, or the DDP comm hook on :attr:`comm`.

    Made by ``torch.distributed.init_process_group("byzcoll", ...)`` (the backend is registered
    when :mod:`byzcoll.torch` is imported) or directly, unconfigured, for torchft::

        pg = ProcessGroupByzcoll()
        manager = torchft.Manager(pg=pg, ...)   # calls pg.configure(...) at each new quorum

    :meth:`configure` (torchft's contract) closes the current communicator and joins a new
    one of ``world_size`` ranks through the store at ``store_addr``; torchft gives a fresh
    store prefix at each quorum change, so the quorum decides who is in. What was set on the
    old communicator (``set_stragglers``, ``set_step``) is set again by the caller on the new
    :attr:`comm`; :attr:`generation` counts the communicators joined.

    Each rank listens for its peers on ``BYZCOLL_TCP_ADDR`` (an IP address), else on the
    address this host's name resolves to. `timeout` bounds a join's wait in the store;
    `step_timeout_ms` is the communicators' step deadline (default ``BYZCOLL_TIMEOUT_MS``, else
    byzcoll's), after which a silent rank is an erasure of the round.
    """

    def __init__(self, store=None, rank=0, world_size=1, timeout=DEFAULT_TIMEOUT, *, step_timeout_ms=None):
        super().__init__(rank, world_size)
        self._rank, self._size = rank, world_size
        self._timeout = timeout
        self._step_timeout_ms = step_timeout_ms
        self._comm = None
        self._error = None
        self.generation = 0
        if store is not None:
            self._join(store, rank, world_size)

    # torchft's contract

    def configure(
        self,
        store_addr,
        replica_id=None,
        rank=0,
        world_size=1,
        quorum_id=None,
        group_rank=None,
        group_world_size=None,
        global_ranks=None,
    ):
        """Joins a new communicator of `world_size` ranks as `rank` through the store at
        `store_addr` (``host:port/prefix``, a prefix no earlier call used), after closing the
        current one. Blocks until every rank has joined; raises :class:`byzcoll.BootstrapError`
        or the store's error (after the timeout) otherwise."""
        self._join(store_client(store_addr, self._timeout), rank, world_size)

    def abort(self):
        """Closes the communicator; calls not yet run are refused (torchft reconfigures)."""
        self._close()

    def shutdown(self):
        """Closes the communicator."""
        self._close()

    def errored(self):
        """The first error a collective of the current communicator raised, else None."""
        return self._error

    def set_timeout(self, timeout):
        """How long later joins wait for the other ranks in the store."""
        self._timeout = timeout

    def size(self):
        return self._size

    def rank(self):
        return self._rank

    def getBackendName(self):
        return BACKEND

    # byzcoll

    @property
    def comm(self) -> Communicator:
        """The current communicator (robust calls, health, stragglers, shrink)."""
        if self._comm is None:
            raise InvalidUsage("the byzcoll process group is not configured: call configure() first")
        return self._comm

    def robust_all_reduce(self, tensor, rule, f, **kwargs):
        """``comm.robust_all_reduce(tensor, rule, f, **kwargs)``: the robust aggregate, in place;
        returns the :class:`byzcoll.Report`."""
        return self.comm.robust_all_reduce(tensor, rule, f, **kwargs)

    # torch.distributed collectives

    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        op = ReduceOp.SUM if opts is None else opts.reduceOp if isinstance(opts, AllreduceOptions) else opts
        name = _op_name(op)
        comm = self.comm
        size = comm.size
        futures = []
        for t in tensors:
            staged = _Staged(t)
            fut = torch.futures.Future()

            def done(error, fut=fut, t=t, staged=staged):
                if error is not None:
                    self._error = self._error or error
                    fut.set_exception(error)
                    return
                staged.write_back()
                if op == ReduceOp.AVG:
                    t.div_(size)
                fut.set_result(t)

            comm._inner._start_all_reduce(staged.array, name, done)
            futures.append(fut)
        if len(futures) == 1:
            return _Work(futures[0].then(lambda f: [f.value()]))
        return _Work(torch.futures.collect_all(futures).then(lambda fs: [f.value() for f in fs.value()]))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def barrier(self, opts=None):
        self.comm.barrier()
        return _done(None)

    def _unsupported(self, what):
        raise UnsupportedError(
            f"the byzcoll process group has no {what}: it offers allreduce (SUM, AVG, MIN, MAX), "
            "barrier and, explicitly, robust_all_reduce"
        )

    def broadcast(self, *args, **kwargs):
        self._unsupported("broadcast")

    def allgather(self, *args, **kwargs):
        self._unsupported("allgather")

    def allgather_into_tensor_coalesced(self, *args, **kwargs):
        self._unsupported("allgather")

    def reduce_scatter(self, *args, **kwargs):
        self._unsupported("reduce_scatter (use byzcoll's robust_reduce_scatter on comm)")

    def reduce_scatter_tensor_coalesced(self, *args, **kwargs):
        self._unsupported("reduce_scatter (use byzcoll's robust_reduce_scatter on comm)")

    def alltoall_base(self, *args, **kwargs):
        self._unsupported("all-to-all")

    def send(self, *args, **kwargs):
        self._unsupported("send")

    def recv(self, *args, **kwargs):
        self._unsupported("recv")

    # membership

    def _join(self, store, rank, world_size):
        if not 0 <= rank < world_size:
            raise InvalidUsage(f"rank {rank} of a world of {world_size}")
        self._close()
        gather = store_allgather(store, rank, world_size, self._timeout)
        self._comm = init_with_allgather(rank, world_size, gather, timeout_ms=self._step_timeout_ms)
        self._rank, self._size = rank, world_size
        self._error = None
        self.generation += 1

    def _close(self):
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close()

    def __repr__(self):
        return f"ProcessGroupByzcoll(rank={self._rank}, size={self._size}, generation={self.generation})"


def _create(store, rank, world_size, timeout):
    """The backend's creator for ``init_process_group("byzcoll")`` and ``new_group``."""
    return ProcessGroupByzcoll(store, rank, world_size, timeout)


def register():
    """Registers the ``"byzcoll"`` backend with ``torch.distributed`` (once): CPU tensors, and
    CUDA tensors staged through pinned host memory."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
