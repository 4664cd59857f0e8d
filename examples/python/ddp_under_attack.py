"""The same classifier as train_under_attack.py, trained the way PyTorch users train: a
DistributedDataParallel model over gloo, its gradient buckets aggregated by byzcoll's median
hook (`byzcoll.torch.register_ddp_comm_hook`), with the last rank Byzantine.

    cargo build --release --bins
    target/release/byzcoll launch -n 4 -- python examples/python/ddp_under_attack.py \\
        --port 29650 --dtypes float32,bfloat16

The Byzantine rank's hook replaces its bucket before the round: `sign-flip` sends its gradient
times -10 x the number of honest ranks, `nan` sends NaN. Every rank trains on its shard with
SGD; rank 0 prints each dtype's final test accuracy and steps per second, and writes them as
JSON with --out. The model, its gradients and the rounds are in the dtype (`bfloat16`: two bytes
per gradient element on the wire).
"""

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import byzcoll
import byzcoll.torch as bt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_under_attack import DTYPES, load, model  # noqa: E402

ATTACKS = ["none", "sign-flip", "nan"]


def byzantine_hook(attack, honest):
    """A DDP hook that lies about this rank's bucket, then takes part in the round as usual."""

    def hook(state, bucket):
        buf = bucket.buffer()
        if attack == "sign-flip":
            buf.mul_(-10.0 * honest)
        elif attack == "nan":
            buf.fill_(float("nan"))
        return bt.ddp_comm_hook(state, bucket)

    return hook


def train(comm, dtype, attack, steps, lr):
    r, n = comm.rank, comm.size
    (x, y), (xt, yt) = load(seed=1, dtype=dtype)
    x, y = x[r::n], y[r::n]
    net = DistributedDataParallel(model(dtype))
    byzantine = r == n - 1 and attack != "none"
    hook = byzantine_hook(attack, n - 1) if byzantine else bt.ddp_comm_hook
    state = bt.register_ddp_comm_hook(net, comm, "median", f=1, hook=hook)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    comm.barrier()
    start = time.monotonic()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    elapsed = time.monotonic() - start
    with torch.no_grad():
        accuracy = float((net.module(xt).argmax(1) == yt).float().mean())
    report = state.last_report
    return {"accuracy": accuracy, "steps_per_second": steps / elapsed,
            "faults": [(rank, kind) for rank, kind, _ in report.faults], "non_finite": report.non_finite}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True, help="torch.distributed's port on 127.0.0.1")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not 1 <= args.steps <= 100_000 or not (0 < args.lr < 100) or not 1 <= args.port <= 65535:
        sys.exit("--steps must be 1..100000, --lr in (0, 100), --port 1..65535")
    dtypes, attacks = args.dtypes.split(","), args.attacks.split(",")
    for name, given, known in [("dtype", dtypes, DTYPES), ("attack", attacks, ATTACKS)]:
        for g in given:
            if g not in known:
                sys.exit(f"unknown {name} {g!r}; known: {', '.join(known)}")
    torch.set_num_threads(1)
    comm = byzcoll.init()
    if comm.size < 4:
        sys.exit("run with at least 4 ranks (the median with f = 1 needs n > 2f + 1 for the hook's check)")
    r = comm.rank
    # torch's store, listening on 127.0.0.1 only: rank 0 binds the socket and hands it over.
    if r == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", args.port))
        listener.listen(1024)
        store = dist.TCPStore("127.0.0.1", args.port, is_master=True, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    else:
        store = dist.TCPStore("127.0.0.1", args.port, is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=r, world_size=comm.size)
    results = {}
    for dtype in dtypes:
        for attack in attacks:
            h = train(comm, DTYPES[dtype], attack, args.steps, args.lr)
            results.setdefault(dtype, {})[attack] = h
            if r == 0:
                print(f"{dtype:>9} {attack:>9}: final accuracy {h['accuracy']:.3f}, "
                      f"{h['steps_per_second']:.1f} steps/s, last round: faults {h['faults']}, "
                      f"non-finite inputs from {h['non_finite']}", flush=True)
    dist.destroy_process_group()
    comm.close()
    if r == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"ranks": comm.size, "results": results}, f)


if __name__ == "__main__":
    main()
