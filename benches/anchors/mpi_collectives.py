"""MPI anchor for benches/collectives.rs: the same collectives with Open MPI + numpy.

Run by the benchmark under mpirun with the tcp btl on loopback; prints the same nccl-tests
columns: MPI Allreduce(SUM), Allgather, and the usual robust workaround, Allgather followed by
numpy.median(axis=0). Each rep is the slowest rank's time after a barrier, after three untimed
calls; the median of at least seven reps is printed.
"""
import argparse
import resource
import time

import numpy as np
from mpi4py import MPI


# As in benches/collectives.rs: untimed calls first, then at least 7 timed reps.
WARM_UP = 3


def reps_for(nbytes):
    return max(7, min(20, (64 << 20) // max(nbytes, 1))) | 1


def timed(comm, reps, op):
    for _ in range(WARM_UP):
        op()
    times = []
    for _ in range(reps):
        comm.Barrier()
        t = time.perf_counter()
        op()
        times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
    times.sort()
    return times[len(times) // 2]


def row(size, count, redop, seconds, bus, rss, label):
    algbw = size / seconds / 1e9
    print(f"{size:>12} {count:>10} {'float':>6} {redop:>7} {seconds * 1e6:>12.1f} "
          f"{algbw:>8.3f} {algbw * bus:>8.3f} {rss:>9.1f}   {label}", flush=True)


def peak_rss_mib(comm):
    """Largest peak RSS of any rank so far (ru_maxrss cannot be reset: ops run in increasing
    memory order, so each figure is that op's peak or an earlier, smaller one)."""
    return comm.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, op=MPI.MAX)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--min-exp", type=int, default=16)
    p.add_argument("--max-exp", type=int, default=24)
    p.add_argument("--btl", default="tcp", help="the btl mpirun was given (for the header)")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    if me == 0:
        print(f"# Open MPI {MPI.Get_library_version().split(',')[0].strip()} (btl {a.btl}, loopback) "
              f"+ numpy {np.__version__}, {n} ranks", flush=True)
    for exp in range(a.min_exp, a.max_exp + 1, 2):
        d = 1 << exp
        nbytes = d * 4
        reps = reps_for(nbytes)
        x = ((me * 7 + np.arange(d) % 13)).astype(np.float32)
        out = np.empty_like(x)
        t = timed(comm, reps, lambda: comm.Allreduce(x, out, op=MPI.SUM))
        rss = peak_rss_mib(comm)
        if me == 0:
            row(nbytes, d, "sum", t, 2 * (n - 1) / n, rss, "MPI Allreduce")
        g = np.empty((n, d), dtype=np.float32)
        t = timed(comm, reps, lambda: comm.Allgather(x, g))
        rss = peak_rss_mib(comm)
        if me == 0:
            row(nbytes * n, d * n, "none", t, (n - 1) / n, rss, "MPI Allgather")

        def gather_median():
            comm.Allgather(x, g)
            np.median(g, axis=0)

        t = timed(comm, reps, gather_median)
        rss = peak_rss_mib(comm)
        if me == 0:
            row(nbytes, d, "median", t, n - 1, rss, "MPI Allgather + numpy.median")


if __name__ == "__main__":
    main()
