"""The PyTorch integration: the robust DDP comm hook trains to the same parameters as the
reference (per-rank gradients, coordinate-wise median, SGD) computed here; a Byzantine rank does
not move them; whole-vector rules are refused on several buckets; async calls complete. Under
torchrun (torchrun_cases.py): errors keep their byzcoll type through DDP and FSDP2, what can be
checked at registration is, and byzcoll.init() refuses torch's store port at once."""

import json
import os
import subprocess
import sys
import tempfile
import threading

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import byzcoll  # noqa: E402
import byzcoll.torch as bt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_worker  # noqa: E402
from helpers import clean_env, is_launcher_var, loopback_store  # noqa: E402


def run_ddp(n, rule, f, steps, bucket_mb, byzantine, mode="ddp"):
    store = loopback_store()
    env = clean_env(WORLD_SIZE=str(n), TEST_PORT=str(store.port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "torch_worker.py"), rule, str(f), str(steps), str(bucket_mb), str(int(byzantine)), mode],
            env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(n)
    ]
    return sorted(last_json_lines(procs, 180, require_success=False), key=lambda o: o["rank"])


def last_json_lines(procs, timeout, require_success):
    """Each process's last JSON line, in order, once they have all ended (each within
    `timeout` s; all are killed where one is not); with `require_success`, each must also
    have exited with status 0."""
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        lines = [l for l in stdout.splitlines() if l.startswith("{")]
        assert (p.returncode == 0 or not require_success) and lines, stdout + stderr
        outs.append(json.loads(lines[-1]))
    return outs


def reference(n, steps, byzantine):
    """Each step: every rank's gradient on its data, the liar's flipped and scaled, the
    coordinate-wise median over ranks, one SGD step."""
    torch.set_num_threads(1)
    model = torch_worker.net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    datasets = [torch_worker.data(r) for r in range(n)]
    for _ in range(steps):
        grads = []
        for r, (x, y) in enumerate(datasets):
            model.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            g = [p.grad.detach().clone() for p in model.parameters()]
            if byzantine and r == n - 1:
                g = [t * -10.0 for t in g]
            grads.append(g)
        for i, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).median(dim=0).values
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


@pytest.mark.parametrize("byzantine", [False, True])
def test_ddp_hook_trains_to_the_reference_parameters(byzantine):
    n, steps = 3, 12
    outs = run_ddp(n, "median", 1, steps, 25.0, byzantine)
    expect = reference(n, steps, byzantine)
    honest = outs[:-1] if byzantine else outs
    for o in honest:
        assert "error" not in o, o
        assert o["params"] == expect, f"rank {o['rank']} differs from the reference"
        assert o["report_inputs"] == n
        assert o["losses"][-1] < o["losses"][0], "training must make progress"


def test_whole_vector_rules_are_refused_on_several_buckets():
    outs = run_ddp(3, "krum", 0, 3, 0.0001, False)  # DDP splits into buckets after step 1
    for o in outs:
        assert "compares whole gradients" in o.get("error", ""), o
        assert "bucket_cap_mb=1)" in o["error"], o  # refused at registration


def test_whole_vector_rules_run_on_one_bucket():
    outs = run_ddp(3, "krum", 0, 3, 100.0, False)
    for o in outs:
        assert "error" not in o, o
    assert outs[0]["params"] == outs[1]["params"] == outs[2]["params"]


@pytest.mark.parametrize("byzantine", [False, True])
def test_fsdp2_robust_reduce_scatter_trains_to_the_reference_parameters(byzantine):
    n, steps = 3, 12
    outs = run_ddp(n, "median", 1, steps, 0, byzantine, mode="fsdp1")
    expect = reference(n, steps, byzantine)
    honest = outs[:-1] if byzantine else outs
    for o in honest:
        assert "error" not in o, o
        # FSDP's sharded SGD step and the reference's are the same float operations.
        assert o["params"] == expect, f"rank {o['rank']} differs from the reference"
        assert o["report_inputs"] == n
        assert o["losses"][-1] < o["losses"][0], "training must make progress"


def test_fsdp2_per_layer_groups_train_with_a_coordinate_wise_rule():
    outs = run_ddp(3, "trimmed-mean", 1, 4, 0, True, mode="fsdp3")
    for o in outs[:-1]:
        assert "error" not in o, o
    assert outs[0]["params"] == outs[1]["params"]


def test_fsdp2_whole_vector_rules_are_refused_on_several_groups():
    outs = run_ddp(3, "krum", 0, 1, 0, False, mode="fsdp3")
    for o in outs:
        assert "fully_shard groups" in o.get("error", ""), o


def test_async_all_reduce_completes_in_order(world_of_one):
    threads = threading.active_count()
    ts = [torch.full((100,), float(i)) for i in range(5)]
    futs = [bt.robust_all_reduce_async(world_of_one, t, "median", 0) for t in ts]
    # A blocking call made after them runs after them.
    after = torch.full((100,), 9.0)
    world_of_one.robust_all_reduce(after, "median", 0)
    for i, fut in enumerate(futs):
        assert fut.wait() is ts[i] and ts[i][0].item() == i
    bad = bt.robust_all_reduce_async(world_of_one, torch.ones(4), "median", 1)
    with pytest.raises(Exception, match="n > 2f"):
        bad.wait()
    refused = bt.robust_all_reduce_async(world_of_one, torch.ones(4), "no-such-rule", 0)
    with pytest.raises(byzcoll.InvalidUsage):
        refused.wait()
    # The communicator's own queue runs them: no Python thread per communicator.
    assert threading.active_count() == threads


def torchrun(case, n=4, **env):
    """Runs torchrun_cases.py CASE under torchrun with `n` ranks and the variables `env`; each
    rank's JSON, in rank order. Its rendezvous is a store of this test's on 127.0.0.1, which
    torchrun joins and does not host (``--standalone`` would host one on every interface)."""
    store = loopback_store()
    with tempfile.TemporaryDirectory() as out:
        env = clean_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **env)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={n}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-conf=is_host=false",
               f"--rdzv-id={case}-{store.port}", os.path.join(HERE, "torchrun_cases.py"), case, out]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        outs = []
        for r in range(n):
            path = os.path.join(out, f"{r}.json")
            assert os.path.exists(path), f"rank {r} wrote nothing:\n{p.stdout}\n{p.stderr[-6000:]}"
            with open(path) as f:
                outs.append(json.load(f))
        assert p.returncode == 0, p.stderr[-6000:]
        return outs


def refused(outcome, type_name, *words):
    assert outcome.get("type") == type_name and outcome["byzcoll"], outcome
    for w in words:
        assert w in outcome["message"], outcome


def test_ddp_hook_errors_keep_their_byzcoll_type_under_torchrun():
    outs = torchrun("ddp_errors")
    for o in outs:
        # Krum with n = 4, f = 1: refused at registration, before any step.
        refused(o["register_krum"], "PreconditionError", "krum needs n > 2f + 2 but has n = 4, f = 1")
        # Registered by hand, the round refuses it, and backward() raises it with its type.
        (step,) = o["by_hand_krum"]
        refused(step, "PreconditionError", "krum needs n > 2f + 2 but has n = 4, f = 1")
        assert "ok" in o["register_bf16"], o["register_bf16"]
        assert all("ok" in step for step in o["bf16_steps"]), o["bf16_steps"]
        # Two NaN ranks of four, f = 1: step 2's backward raises TooManyFaults; the loop that
        # skips it goes on, and DDP with it.
        ok1, nan2, ok3 = o["nan_steps"]
        assert "ok" in ok1 and "ok" in ok3, o["nan_steps"]
        refused(nan2, "TooManyFaults", "median: more than f = 1 inputs are non-finite")
        assert o["inputs"] == 4
    assert all(o["params"] == outs[0]["params"] for o in outs)
    assert all(o["bf16_params"] == outs[0]["bf16_params"] for o in outs)


def test_fsdp2_errors_keep_their_byzcoll_type_under_torchrun():
    outs = torchrun("fsdp_errors")
    for o in outs:
        refused(o["register_krum"], "PreconditionError", "krum needs n > 2f + 2 but has n = 4, f = 1")
        ok1, nan2, ok3 = o["nan_steps"]
        assert "ok" in ok1 and "ok" in ok3, o["nan_steps"]
        refused(nan2, "TooManyFaults")
        assert o["inputs"] == 4  # sharded: no stragglers there
    assert all(o["params"] == outs[0]["params"] for o in outs)


def test_whole_vector_rule_bucket_policy_is_decided_at_registration_under_torchrun():
    outs = torchrun("ddp_buckets")
    for o in outs:
        # 1.9 MB of gradients under DDP's defaults: one bucket at step 1, two from step 2 on.
        step1, step2 = o["by_hand_default"]
        assert "ok" in step1, step1
        refused(step2, "InvalidUsage", "compares whole gradients", "register_ddp_comm_hook")
        refused(o["register_default"], "InvalidUsage", "geometric-median", "(1926404 bytes)",
                "closing a bucket once it holds 1048576 bytes", "bucket_cap_mb=2")
        assert all("ok" in s for s in o["steps"]), o["steps"]
        # Stragglers are allowed by default: the last step may have gone without a late input.
        assert o["inputs"] in (3, 4), o["inputs"]
    assert len({o["params"] for o in outs}) == 1


def test_init_under_torchrun_names_init_from_process_group_at_once():
    # With a job secret exported, as byzcoll.init() needs under torchrun: torch's store holds
    # MASTER_PORT, where byzcoll's rank 0 would host its own.
    for o in torchrun("init_after_torch", BYZCOLL_SECRET=os.urandom(32).hex()):
        for when in ("init_before", "init_after"):
            refused(o[when], "BootstrapError", "MASTER_PORT", "byzcoll.torch.init_from_process_group()")
            assert o[when]["seconds"] < 5, o[when]
        assert "torch.distributed's process group is initialized" in o["init_after"]["message"]
        assert "torchrun's agent" in o["init_before"]["message"]
        assert o["median"] == 1.5, o


def run_pg_workers(argvs, env):
    """Runs pg_worker.py once per argv, concurrently, and returns each one's JSON line."""
    procs = [
        subprocess.Popen([sys.executable, os.path.join(HERE, "pg_worker.py"), *argv], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for argv in argvs
    ]
    return last_json_lines(procs, 120, require_success=True)


def test_byzcoll_backend_sums_and_averages_plainly_and_is_robust_only_when_asked():
    n = 3
    env = clean_env(BYZCOLL_TCP_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    store = loopback_store()
    outs = run_pg_workers([["init", str(r), str(n), str(store.port)] for r in range(n)], env)
    values = [[r + 1.0, -2.0 * (r + 1)] for r in range(n)]
    total = [sum(v[i] for v in values) for i in range(2)]
    for o in outs:
        assert o["backend"] == "byzcoll" and o["is_byzcoll"], o
        assert o["SUM"] == total
        assert o["AVG"] == [x / n for x in total]
        assert o["MIN"] == [1.0, -2.0 * n] and o["MAX"] == [float(n), -2.0]
        assert o["bf16"] == total
        assert o["async"] == [True, total, [total]]
        assert o["two"] == [total, [10 * x for x in total]]
        # Never silently robust, never silently something else: a PRODUCT is refused by type.
        assert o["product"]["type"] == "UnsupportedError" and "SUM, AVG, MIN or MAX" in o["product"]["message"]
        assert o["broadcast"]["type"] == "UnsupportedError", o["broadcast"]
        # The robust aggregate when asked: the last rank's 1e9 moves nothing.
        assert o["median"] == [1.0] * 3 and o["median_faults"] == 0


def test_torchft_contract_reconfigures_through_fresh_store_prefixes_as_quorums_change():
    """What torchft's Manager does with a process group: configure() at each quorum change with
    a fresh store prefix. Three replicas (values 1, 2, 4) form quorum 1; the third leaves and
    quorum 2 is the other two; a restarted replica (value 8) takes the free rank in quorum 3."""
    store = loopback_store()
    env = clean_env(BYZCOLL_TCP_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    p = str(store.port)
    a, b, c, d = run_pg_workers(
        [
            ["quorums", "1", p, "1:0:3,2:0:2,3:0:3"],
            ["quorums", "2", p, "1:1:3,2:1:2,3:1:3"],
            ["quorums", "4", p, "1:2:3"],
            ["quorums", "8", p, "3:2:3"],
        ],
        env,
    )
    for o in (a, b, c, d):
        assert o["unconfigured"]["type"] == "InvalidUsage" and "configure" in o["unconfigured"]["message"]
    assert [q["sum"] for q in a["quorums"]] == [7.0, 3.0, 11.0]
    assert [q["sum"] for q in b["quorums"]] == [7.0, 3.0, 11.0]
    assert [q["sum"] for q in c["quorums"]] == [7.0]
    assert [q["sum"] for q in d["quorums"]] == [11.0]
    assert [(q["size"], q["comm_size"], q["generation"]) for q in a["quorums"]] == [(3, 3, 1), (2, 2, 2), (3, 3, 3)]
    assert [q["rank"] for q in d["quorums"]] == [2]


def test_torchft_manager_trains_over_byzcoll_through_a_replica_killed_and_restarted():
    """examples/python/torchft_train.py: torchft's lighthouse and Managers over the byzcoll
    backend, 4 replicas, one Byzantine (gradients flipped and scaled), one SIGKILLed at step 15
    and restarted: every replica, the restarted one included, ends at the last step with the
    same parameters, and the honest ones' loss fell."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        assert not os.environ.get("BYZCOLL_REQUIRE_MPI"), "torchft must be installed in CI"
        pytest.skip("torchft is not installed")
    example = os.path.join(HERE, "..", "..", "examples", "python", "torchft_train.py")
    steps = 60
    p = subprocess.run(
        [sys.executable, example, "--replicas", "4", "--steps", str(steps), "--kill-at", "15", "--byzantine", "3"],
        env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    assert "killed replica 1 at step" in p.stdout and "restarted replica 1" in p.stdout
    results = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    assert sorted(r["replica"] for r in results) == [0, 1, 2, 3], p.stdout
    assert {r["step"] for r in results} == {steps}
    assert len({r["params"] for r in results}) == 1, results
    assert [r["replica"] for r in results if r["restarted"]] == [1]
    # Survivors joined a communicator per quorum: before the kill, without replica 1, with it again.
    assert min(r["generations"] for r in results if not r["restarted"]) >= 3, results
    for r in results:
        if not r["byzantine"]:
            assert r["loss"] < r["initial_loss"] / 5, r


class Foreign:
    """An array of another library (CuPy, JAX, ...) as byzcoll sees it: DLPack and nothing else."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, **kwargs):
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def test_arrays_of_other_libraries_are_taken_through_dlpack_in_place(world_of_one):
    """An array that speaks only DLPack is read and written in place, with no copy: a
    reduce-scatter's output and an all-reduce's vector hold the results afterwards."""
    comm = world_of_one
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        want = torch.arange(6, dtype=dtype)
        out = Foreign(torch.zeros(6, dtype=dtype))
        report = comm.robust_reduce_scatter(Foreign(want.clone()), out, "median", 0)
        assert torch.equal(out.tensor, want) and report.inputs == 1, dtype
        x = Foreign(want.clone())
        comm.all_reduce(x, "sum")
        assert torch.equal(x.tensor, want), dtype
    x = Foreign(torch.arange(4.0))
    assert comm.robust_all_reduce(x, "median", f=0).staged_bytes == 0
    with pytest.raises(byzcoll.InvalidUsage, match="float32"):
        comm.robust_all_reduce(Foreign(torch.arange(4)), "median", f=0)

    class JaxArray(Foreign):
        """What byzcoll sees of a JAX array: immutable, so never written in place."""

    JaxArray.__module__ = "jaxlib.xla_extension"
    with pytest.raises(byzcoll.InvalidUsage, match="immutable"):
        comm.robust_all_reduce(JaxArray(torch.arange(4.0)), "median", f=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SKIPPED: no CUDA device here (CUDA tensors are staged through pinned host memory)")
def test_cuda_tensors_are_staged_through_pinned_host_memory(world_of_one):
    """A CUDA tensor in every entry point: the call works on a pinned host copy and writes the
    result back to the device tensor (a world of one: the median of one vector is itself)."""
    comm = world_of_one
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = torch.arange(1000, device="cuda", dtype=torch.float32).to(dtype)
        x = torch.empty_like(want)
        x.copy_(want)  # queued on the stream: the staging copy must wait for it
        report = comm.robust_all_reduce(x, "median", f=0)
        assert x.is_cuda and torch.equal(x, want) and report.inputs == 1, dtype
        assert report.staged_bytes == 2 * x.nbytes, "one copy each way, counted"
        fut = bt.robust_all_reduce_async(comm, x, "median", 0)
        assert fut.wait() is x and torch.equal(x, want)
        out = torch.empty(1000, device="cuda", dtype=dtype)
        report = comm.robust_reduce_scatter(x, out, "median", 0)
        assert torch.equal(out, want)
        assert report.staged_bytes == 2 * x.nbytes, "the input in, the output back"
        comm.all_reduce(x, "sum")
        assert torch.equal(x, want)
    with pytest.raises(byzcoll.InvalidUsage, match="contiguous"):
        comm.robust_all_reduce(torch.zeros(4, 4, device="cuda").t(), "median", f=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SKIPPED: no CUDA device here (CUDA tensors go device to device over NCCL)")
def test_cuda_tensors_over_nccl_go_device_to_device(monkeypatch):
    """Over NCCL a CUDA tensor is lent to the CUDA kernels: no host copy (a world of one: the
    median of one vector is itself, after the work queued on the tensor's stream)."""
    for k in list(os.environ):
        if is_launcher_var(k):
            monkeypatch.delenv(k)
    monkeypatch.setenv("BYZCOLL_RANK", "0")
    monkeypatch.setenv("BYZCOLL_WORLD_SIZE", "1")
    monkeypatch.setenv("BYZCOLL_TRANSPORT", "nccl")
    comm = byzcoll.init()
    try:
        assert comm.transport == "nccl"
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            want = torch.arange(1000, device="cuda", dtype=torch.float32).to(dtype)
            x = torch.empty_like(want)
            x.copy_(want)  # queued on the stream: the call must wait for it
            report = comm.robust_all_reduce(x, "median", f=0)
            assert x.is_cuda and torch.equal(x, want) and report.inputs == 1, dtype
            assert report.staged_bytes == 0, "no host copy"
        # What the CUDA kernels do not take is staged through host memory instead.
        x = torch.arange(8, device="cuda", dtype=torch.float64)
        assert comm.robust_all_reduce(x, "median", f=0).staged_bytes == 2 * x.nbytes
        x = torch.arange(8, device="cuda", dtype=torch.float32)
        assert comm.robust_all_reduce(x, "mean", f=0).staged_bytes == 2 * x.nbytes
        with pytest.raises(byzcoll.InvalidUsage, match="requires grad"):
            comm.robust_all_reduce(torch.zeros(4, device="cuda", requires_grad=True), "median", f=0)
        # The async call (the DDP hook's) and the reduce-scatter (FSDP2's) stay on the device.
        for dtype in (torch.float32, torch.bfloat16):
            want = torch.arange(1000, device="cuda", dtype=torch.float32).to(dtype)
            x = want.clone()
            assert bt.robust_all_reduce_async(comm, x, "median", 0).wait() is x
            assert torch.equal(x, want), dtype
            out = torch.zeros(1000, device="cuda", dtype=dtype)
            report = comm.robust_reduce_scatter(want, out, "median", 0)
            assert torch.equal(out, want) and report.staged_bytes == 0, dtype
    finally:
        comm.close()


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="SKIPPED: no CUDA device here (a CUDA model's DDP hook over NCCL)"
    )),
])
def test_ddp_hook_in_a_world_of_one_trains_as_the_model_alone_on_cpu_and_cuda(monkeypatch, device):
    """DDP in float32 and bfloat16 with the median hook, in a world of one: the model trains
    exactly as it does alone, and no bucket crosses to the host. On a CUDA model the hook runs
    over NCCL, device to device."""
    import torch.distributed as dist

    for k in list(os.environ):
        if is_launcher_var(k):
            monkeypatch.delenv(k)
    monkeypatch.setenv("BYZCOLL_RANK", "0")
    monkeypatch.setenv("BYZCOLL_WORLD_SIZE", "1")
    if device == "cuda":
        monkeypatch.setenv("BYZCOLL_TRANSPORT", "nccl")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm = byzcoll.init()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            alone = torch_worker.net().to(device, dtype)  # the same seeded weights each time
            model = torch.nn.parallel.DistributedDataParallel(torch_worker.net().to(device, dtype))
            state = bt.register_ddp_comm_hook(model, comm, "median", f=0)
            x, y = (t.to(device, dtype) for t in torch_worker.data(0))
            for net in (alone, model):
                opt = torch.optim.SGD(net.parameters(), lr=0.05)
                for _ in range(5):
                    opt.zero_grad()
                    ((net(x) - y) ** 2).mean().backward()
                    opt.step()
            assert state.last_report is not None and state.last_report.staged_bytes == 0, dtype
            for a, b in zip(alone.parameters(), model.module.parameters()):
                assert torch.equal(a, b), dtype
    finally:
        comm.close()
        dist.destroy_process_group()


def test_the_transport_is_named(world_of_one):
    assert world_of_one.transport in ("tcp", "local"), world_of_one.transport


def test_host_tensors_are_not_staged(world_of_one):
    x = torch.arange(8, dtype=torch.bfloat16)
    assert world_of_one.robust_all_reduce(x, "median", f=0).staged_bytes == 0
    assert torch.equal(x, torch.arange(8, dtype=torch.bfloat16))


def test_tensors_on_other_devices_are_refused_by_type(world_of_one):
    with pytest.raises(byzcoll.InvalidUsage, match="tensor on meta"):
        world_of_one.robust_all_reduce(torch.zeros(4, device="meta"), "median", f=0)
