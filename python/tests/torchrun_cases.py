"""The PyTorch user's path, one rank of it, run under torchrun (``torchrun --nproc-per-node 4
torchrun_cases.py CASE OUT``, its rendezvous on a store of the test's on 127.0.0.1): each case does what a training script does and
writes what each call did (its exception's type and message, or what it returned) to
``OUT/RANK.json`` for test_torch.py to check."""

import json
import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import byzcoll


def outcome(call):
    """What `call()` did: ``{"ok": value}`` or the exception's type, message and whether it is a
    byzcoll error, with the seconds it took."""
    start = time.monotonic()
    try:
        out = {"ok": call()}
    except Exception as e:
        out = {"type": type(e).__name__, "message": str(e), "byzcoll": isinstance(e, byzcoll.Error)}
    out["seconds"] = time.monotonic() - start
    return out


def data(rank, width):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(32, width, generator=g)
    return x, x.sum(1, keepdim=True) * 0.5


def net(width=8, hidden=16, layers=1, dtype=torch.float32):
    """An MLP of `layers` hidden layers of `hidden` units on `width` inputs."""
    torch.manual_seed(0)
    sizes = [width] + [hidden] * layers
    body = [m for a, b in zip(sizes, sizes[1:]) for m in (torch.nn.Linear(a, b), torch.nn.Tanh())]
    return torch.nn.Sequential(*body, torch.nn.Linear(hidden, 1)).to(dtype)


def train(model, rank, steps, *, nan_at=None, nan_ranks=(), width=8, dtype=torch.float32):
    """`steps` SGD steps on data of `dtype`; at step `nan_at` the ranks in `nan_ranks` have NaN
    gradients. A step whose backward raises is skipped, as a training loop that catches the
    error would."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = (t.to(dtype) for t in data(rank, width))
    out = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if step == nan_at and rank in nan_ranks:
            loss = loss * float("nan")
        result = outcome(lambda: loss.backward())
        if "ok" in result:
            opt.step()
        out.append(result)
    return out


def params(model):
    return [p.detach().flatten().tolist() for p in model.parameters()]


def ddp_errors(comm, rank, size):
    """Errors of the DDP hook keep their byzcoll type: a precondition refused at registration,
    the same one raised by backward() when the hook was registered by hand, and a round's
    TooManyFaults (two ranks of four with NaN gradients, median with f = 1) raised by the
    backward() of its step, the steps around it training on."""
    import byzcoll.torch as bt

    # Every input waited for: step 2's TooManyFaults needs both NaN ranks' gradients at every
    # rank (with stragglers allowed, ranks that went on without a late NaN rank would take the
    # step while the late one fails it, loudly but apart).
    comm.set_stragglers(0)
    out = {}
    out["register_krum"] = outcome(lambda: bt.register_ddp_comm_hook(DDP(net()), comm, "krum", 1) and None)
    by_hand = DDP(net())
    by_hand.register_comm_hook(bt.HookState(comm, "krum", 1), bt.ddp_comm_hook)
    out["by_hand_krum"] = train(by_hand, rank, 1)
    # A bfloat16 model trains too: two bytes per gradient element on the wire, and the median
    # of bfloat16 values is one of them, so every rank steps alike.
    bf16 = DDP(net(dtype=torch.bfloat16))
    out["register_bf16"] = outcome(lambda: bt.register_ddp_comm_hook(bf16, comm, "median", 1) and None)
    out["bf16_steps"] = train(bf16, rank, 2, dtype=torch.bfloat16)
    out["bf16_params"] = params(bf16.module)
    model = DDP(net())
    state = bt.register_ddp_comm_hook(model, comm, "median", 1)
    out["nan_steps"] = train(model, rank, 3, nan_at=2, nan_ranks=(size - 2, size - 1))
    out["inputs"] = state.last_report.inputs
    out["params"] = params(model.module)
    return out


def fsdp_errors(comm, rank, size):
    """The same through FSDP2's robust reduce-scatter."""
    import byzcoll.torch as bt
    from torch.distributed.fsdp import fully_shard

    out = {}
    model = net()
    fully_shard(model)
    out["register_krum"] = outcome(lambda: bt.fsdp_robust_reduce_scatter(model, comm, "krum", 1) and None)
    model = net()
    fully_shard(model)
    rs = bt.fsdp_robust_reduce_scatter(model, comm, "median", 1)
    out["nan_steps"] = train(model, rank, 3, nan_at=2, nan_ranks=(size - 2, size - 1))
    out["inputs"] = rs.last_report.inputs
    out["params"] = [p.full_tensor().detach().flatten().tolist() for p in model.parameters()]
    return out


def ddp_buckets(comm, rank, size):
    """A whole-vector rule on a model (1.9 MB of float32 gradients) that DDP, under its defaults,
    reduces in one bucket at step 1 and in two from step 2 on (buckets close at 1 MiB after
    step 1). Registered by hand, step 2 is refused; registered through register_ddp_comm_hook,
    it is refused before step 1, naming the bucket_cap_mb to pass; with it, three steps."""
    import byzcoll.torch as bt

    width, layers = 400, 3
    by_hand = DDP(net(width, width, layers))
    by_hand.register_comm_hook(bt.HookState(comm, "geometric-median", 1), bt.ddp_comm_hook)
    out = {"by_hand_default": train(by_hand, rank, 2, width=width)}
    out["register_default"] = outcome(
        lambda: bt.register_ddp_comm_hook(DDP(net(width, width, layers)), comm, "geometric-median", 1) and None
    )
    model = DDP(net(width, width, layers), bucket_cap_mb=2)
    state = bt.register_ddp_comm_hook(model, comm, "geometric-median", 1)
    out["steps"] = train(model, rank, 3, width=width)
    out["inputs"] = state.last_report.inputs
    out["params"] = sum(p.detach().double().sum().item() for p in model.parameters())
    return out


def init_after_torch(rank, size):
    """byzcoll.init() under torchrun, before and after dist.init_process_group: a BootstrapError
    at once that names init_from_process_group, which then works."""
    import numpy as np
    import torch.distributed as dist

    out = {"init_before": outcome(lambda: byzcoll.init() and None)}
    dist.init_process_group("gloo")
    out["init_after"] = outcome(lambda: byzcoll.init() and None)
    import byzcoll.torch as bt

    comm = bt.init_from_process_group(listen="127.0.0.1")
    x = np.full(10, float(rank), dtype=np.float32)
    comm.robust_all_reduce(x, "median", 1)
    out["median"] = float(x[0])
    comm.close()
    return out


def main():
    case, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if case == "init_after_torch":
        out = init_after_torch(rank, size)
    else:
        import byzcoll.torch as bt
        import torch.distributed as dist

        dist.init_process_group("gloo")
        comm = bt.init_from_process_group(listen="127.0.0.1")
        out = globals()[case](comm, rank, size)
        comm.close()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(out, f)
    dist = sys.modules["torch.distributed"]
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
