"""One rank of the DDP tests: torch.distributed (gloo on 127.0.0.1), byzcoll joined through it,
a tiny model trained with the robust comm hook; prints its final parameters as JSON."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import byzcoll
import byzcoll.torch as bt


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(32, 8, generator=g)
    return x, x.sum(1, keepdim=True) * 0.5 + 0.1 * torch.randn(32, 1, generator=g)


def fsdp(rule, f, steps, groups, byzantine, rank, size, comm):
    """FSDP2: the model sharded as one group (or one per layer plus the root), gradients
    reduce-scattered by byzcoll; prints the full parameters after training."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = net()
    if groups > 1:
        for layer in (model[0], model[2]):
            fully_shard(layer)
    fully_shard(model)
    try:
        rs = bt.fsdp_robust_reduce_scatter(model, comm, rule, f)
    except byzcoll.Error as e:
        print(json.dumps({"rank": rank, "error": str(e)}), flush=True)
        return
    if byzantine and rank == size - 1:
        rs = _Liar(comm, rule, f)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(rs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data(rank)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = [p.full_tensor().detach().flatten().tolist() for p in model.parameters()]
    print(json.dumps({"rank": rank, "params": params, "losses": losses,
                      "report_inputs": rs.last_report.inputs}), flush=True)


class _Liar(bt.RobustReduceScatter):
    """The Byzantine rank's reduce-scatter: its gradients, flipped and scaled, then the robust one."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        input_tensor.mul_(-10.0)
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def main():
    rule, f, steps, bucket_mb, byzantine = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5] == "1"
    mode = sys.argv[6] if len(sys.argv) > 6 else "ddp"
    torch.set_num_threads(1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A client of the test's store, which listens on 127.0.0.1 only.
    store = dist.TCPStore("127.0.0.1", int(os.environ["TEST_PORT"]), is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    comm = bt.init_from_process_group(listen="127.0.0.1")
    if mode.startswith("fsdp"):
        fsdp(rule, f, steps, int(mode[4:] or 1), byzantine, rank, size, comm)
        comm.close()
        dist.destroy_process_group()
        return
    model = DistributedDataParallel(net(), bucket_cap_mb=bucket_mb)
    hook = bt.ddp_comm_hook
    if byzantine and rank == size - 1:
        def hook(state, bucket):  # the Byzantine rank: its gradient, flipped and scaled
            bucket.buffer().mul_(-10.0)
            return bt.ddp_comm_hook(state, bucket)
    try:
        state = bt.register_ddp_comm_hook(model, comm, rule, f, hook=hook)
    except byzcoll.Error as e:
        print(json.dumps({"rank": rank, "error": str(e)}), flush=True)
        return
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = data(rank)
    losses = []
    try:
        for _ in range(steps):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    except Exception as e:  # DDP wraps the hook's exception
        print(json.dumps({"rank": rank, "error": str(e)}), flush=True)
        return
    params = [p.detach().flatten().tolist() for p in model.module.parameters()]
    print(json.dumps({"rank": rank, "params": params, "losses": losses,
                      "report_inputs": state.last_report.inputs}), flush=True)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
