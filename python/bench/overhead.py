"""Python overhead, under `byzcoll launch -n 4` (`python/bench/overhead.sh` runs it next to
its Rust twin, `examples/overhead.rs`, alternating, and prints the ratios):

1. `--part allreduce`: `comm.robust_all_reduce` (median f = 1, gather) from Python at 4 KiB,
   1 MiB and 64 MiB per rank, the same loop as `examples/overhead.rs`;
2. `--part ddp`: a DistributedDataParallel step with byzcoll's median hook against PyTorch's own
   gloo all-reduce (no hook) on the same model, in the same job; and the hook on the same model
   in bfloat16 (two bytes per gradient element), with its ratio to the float32 hook.

    target/release/byzcoll launch -n 4 -- python python/bench/overhead.py --port 29611

Times are the slowest rank's (MAX over ranks), median over the reps, in ms.
"""

import argparse
import os
import socket
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import byzcoll
import byzcoll.torch as bt


def slowest(comm, seconds):
    t = np.array([seconds], dtype=np.float64)
    comm.all_reduce(t, "max")
    return float(t[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True, help="torch.distributed's port on 127.0.0.1")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--part", choices=["allreduce", "ddp", "all"], default="all")
    args = ap.parse_args()
    torch.set_num_threads(1)
    comm = byzcoll.init()
    r, n = comm.rank, comm.size
    if r == 0 and args.part != "ddp":
        print(f"# {n} ranks, median f = 1, gather, agreement {os.environ.get('BYZCOLL_AGREEMENT', 'detect')}")
        print(f"{'bytes':>10} {'python ms':>10}")
    for size in [4096, 1 << 20, 64 << 20] if args.part != "ddp" else []:
        x = np.full(size // 4, float(r), dtype=np.float32)
        reps = args.reps * 10 if size <= (64 << 10) else args.reps if size < (64 << 20) else min(args.reps, 5)
        times = []
        for i in range(reps + 1):
            comm.barrier()
            t0 = time.perf_counter()
            comm.robust_all_reduce(x, "median", 1)
            t = slowest(comm, time.perf_counter() - t0)
            if i > 0:
                times.append(t)
        if r == 0:
            print(f"{size:>10} {statistics.median(times) * 1e3:>10.3f}", flush=True)

    if args.part == "allreduce":
        comm.close()
        return
    # torch's store, listening on 127.0.0.1 only: rank 0 binds the socket and hands it over.
    if r == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", args.port))
        listener.listen(1024)
        store = dist.TCPStore("127.0.0.1", args.port, is_master=True, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    else:
        store = dist.TCPStore("127.0.0.1", args.port, is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=r, world_size=n)
    width = 512
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(r))
    results = {}
    for name in ["gloo all-reduce", "byzcoll median", "byzcoll median bf16"]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])  # ~1M parameters
        dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
        net, x = net.to(dtype), x.to(dtype)
        model = DistributedDataParallel(net)
        if name.startswith("byzcoll"):
            model.register_comm_hook(bt.HookState(comm, "median", 1), bt.ddp_comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        times = []
        for i in range(args.reps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            t = slowest(comm, time.perf_counter() - t0)
            if i > 1:
                times.append(t)
        results[name] = statistics.median(times)
    if r == 0:
        params = sum(p.numel() for p in net.parameters())
        print(f"# DDP step, {params} parameters, batch 64, 1 thread per rank (ms)")
        for name, t in results.items():
            print(f"{name:>16} {t * 1e3:>10.2f}")
        print(f"{'ratio':>16} {results['byzcoll median'] / results['gloo all-reduce']:>10.2f}")
        print(f"{'bf16 / f32 hook':>16} {results['byzcoll median bf16'] / results['byzcoll median']:>10.2f}")
    dist.destroy_process_group()
    comm.close()


if __name__ == "__main__":
    main()
