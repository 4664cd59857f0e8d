"""One rank of a job on the ``"byzcoll"`` torch.distributed backend, for test_torch.py; prints
what it saw as one JSON line.

``pg_worker.py init RANK SIZE STORE_PORT``: joins through ``init_process_group("byzcoll")`` with
a client of the test's store (on 127.0.0.1) and runs torch's collectives, a robust call (the last rank lies) and an unsupported op.

``pg_worker.py quorums VALUE STORE_PORT QID:RANK:SIZE,...``: an unconfigured process group
configured as torchft's Manager does it, once per quorum listed (a fresh store prefix each), and
in each a SUM of VALUE over that quorum."""

import json
import sys

import torch
import torch.distributed as dist

import byzcoll
import byzcoll.torch as bt


def outcome(call):
    try:
        return {"ok": call()}
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e), "byzcoll": isinstance(e, byzcoll.Error)}


def init(rank, size, port):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group("byzcoll", store=store, rank=rank, world_size=size)
    pg = dist.group.WORLD
    out = {"rank": rank, "backend": dist.get_backend(), "is_byzcoll": isinstance(pg, bt.ProcessGroupByzcoll)}
    base = torch.tensor([rank + 1.0, -2.0 * (rank + 1)])
    for op in ("SUM", "AVG", "MIN", "MAX"):
        t = base.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[op] = t.tolist()
    t = base.clone().to(torch.bfloat16)
    dist.all_reduce(t)
    out["bf16"] = t.float().tolist()
    t = base.clone()
    work = dist.all_reduce(t, async_op=True)
    out["async"] = [work.wait(), t.tolist(), [x.tolist() for x in work.get_future().value()]]
    both = [base.clone(), base.clone() * 10]
    pg.allreduce(both).wait()
    out["two"] = [x.tolist() for x in both]
    out["product"] = outcome(lambda: dist.all_reduce(base.clone(), op=dist.ReduceOp.PRODUCT))
    out["broadcast"] = outcome(lambda: dist.broadcast(base.clone(), src=0))
    liar = torch.full((3,), 1e9 if rank == size - 1 else float(rank))
    report = pg.robust_all_reduce(liar, "median", f=1)
    out["median"] = liar.tolist()
    out["median_faults"] = len(report.faults)
    dist.barrier()
    dist.destroy_process_group()
    return out


def quorums(value, store_port, plan):
    pg = bt.ProcessGroupByzcoll()
    out = {"value": value, "quorums": []}
    out["unconfigured"] = outcome(lambda: pg.allreduce([torch.zeros(1)]))
    for step in plan.split(","):
        qid, rank, size = (int(x) for x in step.split(":"))
        pg.configure(f"127.0.0.1:{store_port}/torchft/{qid}/0", "replica", rank, size, qid)
        t = torch.tensor([float(value)])
        pg.allreduce([t], dist.ReduceOp.SUM).wait()
        out["quorums"].append(
            {"qid": qid, "rank": pg.rank(), "size": pg.size(), "comm_size": pg.comm.size, "sum": t.item(), "generation": pg.generation}
        )
    pg.shutdown()
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "init":
        result = init(int(args[0]), int(args[1]), int(args[2]))
    else:
        result = quorums(int(args[0]), int(args[1]), args[2])
    print(json.dumps(result), flush=True)
