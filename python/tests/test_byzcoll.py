"""byzcoll from Python: multi-process jobs over TCP on 127.0.0.1 (what `byzcoll launch` sets
up, done here by hand), bad inputs in a world of one, mpi4py bootstrap under mpirun."""

import json
import os
import secrets
import shutil
import subprocess
import sys

import numpy as np
import pytest

import byzcoll
from helpers import clean_env, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")


def run_job(n, scenario, dtype="float32", **env):
    """Starts n ranks of worker.py as byzcoll launch would (with `env` on top), returns their
    JSON lines by rank."""
    store, secret = f"127.0.0.1:{free_port()}", secrets.token_hex(32)
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, scenario, dtype],
            env=clean_env(
                BYZCOLL_RANK=str(r),
                BYZCOLL_WORLD_SIZE=str(n),
                BYZCOLL_STORE=store,
                BYZCOLL_SECRET=secret,
                BYZCOLL_TIMEOUT_MS="20000",
                **env,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(n)
    ]
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return sorted(outs, key=lambda o: o["rank"])


@pytest.mark.parametrize("n", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_rank_gets_the_median(n, dtype):
    outs = run_job(n, "honest", dtype)
    expect = float(np.median(np.arange(1, n + 1, dtype=dtype)))
    f = (n - 1) // 2
    # Trimmed mean: drop f from each end of 1..n.
    trimmed = float(np.mean(np.arange(1 + f, n + 1 - f, dtype=np.float64)))
    for o in outs:
        assert o["size"] == n
        assert o["median"] == expect and o["uniform"], o
        assert o["same_buffer"], "the result must land in the caller's buffer"
        assert o["inputs"] == n and o["faults"] == []
        # A job secret without per-rank keys: the report says how much the membership holds.
        assert o["identity"] == ("shared-secret" if n > 1 else "local"), o
        assert o["steps"] == 2, o  # the gather exchange and the cross-check
        # Each peer gets the 1000-element vector; the cross-check messages come on top.
        assert o["bytes"][0] >= (n - 1) * 1000 * np.dtype(dtype).itemsize and o["bytes"][1] >= o["bytes"][0], o
        assert o["trimmed_sharded"] == trimmed, o
        assert o["reduce_scatter_matches"] and o["reduce_scatter_input_kept"], o
        assert o["reduce_scatter_faults"] == [], o
        assert o["sum"] == n * (n + 1) / 2
        if n > 1:
            assert o["agreement"] == {
                "disagreeing": [],
                "unconfirmed": [],
                "differing_inputs": [],
                "differing_versions": [],
                "realigned": [],
                "recovered": [],
            }


def test_a_byzantine_rank_does_not_move_the_median():
    outs = run_job(4, "byzantine")
    for o in outs[:3]:
        assert o["median"] == 2.5, o  # median of {1, 2, 3, 1e9}
        assert o["sum"] > 1e8, "the plain sum is dragged away by the one liar"
        # The report names the liar: its deviation is 2e9 median deviations.
        assert o["outlying"] == [3], o
        liar = o["attribution"][3]
        assert liar["rank"] == 3 and liar["score"] > 1e6 and liar["extreme"] == 1.0, o
        assert all(a["score"] <= byzcoll.OUTLYING_SCORE for a in o["attribution"][:3]), o
        outlying, score = o["health_scores"]["3"]  # JSON keys are strings
        assert outlying == 1 and score > 1e6, o
    assert outs[0]["attribution"] == outs[1]["attribution"] == outs[2]["attribution"]


def test_audited_owners_are_audited_and_honest_ones_never_convicted():
    outs = run_job(4, "audited")
    want = [float(np.median(np.arange(4) + i)) for i in range(4)]
    for o in outs:
        assert o["result"] == want, o
        assert o["replicas"] == 1, o
        audit = o["audit"]
        assert sorted(owner for owner, _ in audit["audited"]) == [
            p for p in range(4) if p != o["rank"]
        ], o
        assert audit["convicted"] == [] and audit["false_accusers"] == [], o


def test_a_straggler_does_not_set_the_pace():
    outs = run_job(4, "straggler", BYZCOLL_AGREEMENT="enforce")
    for o in outs[:3]:
        assert o["seconds"] < 0.75, o  # the straggler comes 1.5 s later
        assert o["median"] == 2.0, o  # median of {1, 2, 3}: rank 3's 4 was late
        assert [(f[0], f[1]) for f in o["faults"]] == [(3, "late")], o
        assert o["stragglers"] == 1, o
        late = [h for h in o["health"] if h["rank"] == 3][0]
        assert late["streak"] == ["late", 1] and late["late"] == 1, o
        assert all(h["streak"] is None for h in o["health"] if h["rank"] != 3), o
    # Under enforce the echo tells the straggler its input was late: it returns their result.
    assert outs[3]["median"] == 2.0 and outs[3]["erased_self"], outs[3]


def test_shrink_drops_a_rank_that_left_and_renumbers_the_rest():
    outs = run_job(4, "shrink")
    for o in outs:
        if o["rank"] == 2:
            continue
        assert o["new"] == [{0: 0, 1: 1, 3: 2}[o["rank"]], 3], o
        assert o["median"] == 2.0 and o["faults"] == [], o  # median of {1, 2, 4}


def test_a_rank_that_died_rejoins_when_the_launcher_restarts_it():
    """`byzcoll launch --restarts 1`: rank 3 exits at round 3, the launcher starts it again with
    BYZCOLL_REJOIN=1 (its `byzcoll.init()` knocks), and the others shrink and admit it at a
    boundary: from there the four agree again, and every rank finishes the twelve rounds."""
    cli = os.environ.get("BYZCOLL_BIN")
    if not cli or not os.path.exists(cli):
        assert not os.environ.get("BYZCOLL_REQUIRE_MPI"), "BYZCOLL_BIN must name the byzcoll binary in CI"
        pytest.skip("BYZCOLL_BIN (the byzcoll CLI) is not set")
    done = subprocess.run(
        [cli, "launch", "-n", "4", "--restarts", "1", "--", sys.executable, WORKER, "rejoin", "float32"],
        env=clean_env(BYZCOLL_TIMEOUT_MS="5000"), capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 3 exited with status 3; starting it again to rejoin" in done.stderr, done.stderr
    outs = {}
    for line in done.stdout.splitlines():
        rank, _, body = line.partition("] ")
        if body.startswith("{"):
            outs[int(rank.lstrip("["))] = json.loads(body)
    assert sorted(outs) == [0, 1, 2, 3], done.stdout
    (rejoined,) = [e for e in outs[3]["events"] if e[0] == "rejoined"]
    at = rejoined[1]
    assert rejoined[2:] == [[0, 1, 2, 3], 1], rejoined
    for r in range(3):
        admitted = [e for e in outs[r]["events"] if e[0] == "admitted"]
        assert admitted == [["admitted", at, [3], 1]], outs[r]
        rounds = {e[1]: e for e in outs[r]["events"] if e[0] == "round"}
        assert rounds[3][2:] == [2.0, [0, 1, 2, 3], [3]], rounds[3]  # median of 1, 2, 3
    for r in range(4):
        rounds = {e[1]: e for e in outs[r]["events"] if e[0] == "round"}
        assert rounds[at][2:] == [2.5, [0, 1, 2, 3], []], (r, rounds[at])  # median of 1..4
        assert outs[r]["job_ranks"] == [0, 1, 2, 3]


def test_a_rank_out_of_step_is_named_never_mixed_in():
    outs = run_job(4, "out_of_step")
    for o in outs[:3]:
        assert o["median"] == 2.0, o  # median of {1, 2, 3}: rank 3's call is another one
        assert [(f[0], f[1]) for f in o["faults"]] == [(3, "out-of-step")], o
    assert outs[3]["error"] == "TooManyFaults", outs[3]
    assert {f[1] for f in outs[3]["faults"]} == {"out-of-step"}, outs[3]


def test_enforce_gives_every_rank_the_same_median_in_both_modes_and_refuses_reduce_scatter():
    outs = run_job(4, "enforce", BYZCOLL_AGREEMENT="enforce")
    for o in outs:
        assert o["median"] == 2.5 and o["uniform"], o  # median of {1, 2, 3, 1e9}, the liar's too
        assert o["inputs"] == 4 and o["faults"] == [] and not o["erased_self"], o
        assert o["steps"] == 4, o  # gather, one relay (f = 1), recovery, cross-check
        # Sharded (3 owners a shard): scatter, versions, one relay, recovery, cross-check.
        assert o["sharded"] == 2.5 and o["sharded_uniform"], o
        assert o["sharded_steps"] == 5, o
        assert "reduce-scatter" in o["reduce_scatter"], o


def test_bad_inputs_are_clear_exceptions(world_of_one):
    comm = world_of_one
    x = np.ones(8, dtype=np.float32)
    with pytest.raises(byzcoll.InvalidUsage, match="float32, float64, float16 or bfloat16"):
        comm.robust_all_reduce(np.ones(8, dtype=np.int32), "median", 0)
    # An int16 array is never taken for bfloat16 words.
    with pytest.raises(byzcoll.InvalidUsage, match="<i2"):
        comm.robust_all_reduce(np.ones(8, dtype=np.int16), "median", 0)
    with pytest.raises(byzcoll.InvalidUsage, match="C-contiguous"):
        comm.robust_all_reduce(np.ones(16, dtype=np.float32)[::2], "median", 0)
    ro = np.ones(8, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(byzcoll.InvalidUsage, match="read-only"):
        comm.robust_all_reduce(ro, "median", 0)
    with pytest.raises(byzcoll.InvalidUsage, match="average"):
        comm.robust_all_reduce(x, "average", 0)
    with pytest.raises(byzcoll.PreconditionError, match="n > 2f"):
        comm.robust_all_reduce(x, "median", 1)
    with pytest.raises(byzcoll.InvalidUsage, match="policy"):
        comm.robust_all_reduce(x, "median", 0, policy="scatter")
    with pytest.raises(byzcoll.InvalidUsage, match="replicas"):
        comm.robust_all_reduce(x, "median", 0, replicas=2)
    with pytest.raises(byzcoll.InvalidUsage, match="replicas"):
        comm.robust_all_reduce(x, "median", 0, policy="auto", replicas=3)
    with pytest.raises(byzcoll.InvalidUsage, match="op"):
        comm.all_reduce(x, "avg")
    with pytest.raises(TypeError, match="numpy array"):
        comm.robust_all_reduce([1.0, 2.0], "median", 0)
    with pytest.raises(TypeError):
        comm.robust_all_reduce(x, "median")  # no default f
    with pytest.raises(byzcoll.InvalidUsage, match="shard"):
        comm.robust_reduce_scatter(x, np.empty(7, dtype=np.float32), "median", 0)
    with pytest.raises(byzcoll.InvalidUsage, match="same dtype"):
        comm.robust_reduce_scatter(x, np.empty(8, dtype=np.float64), "median", 0)
    with pytest.raises(byzcoll.InvalidUsage, match="overlap"):
        comm.robust_reduce_scatter(x, x, "median", 0)
    with pytest.raises(byzcoll.InvalidUsage, match="read-only"):
        comm.robust_reduce_scatter(x, ro, "median", 0)
    assert issubclass(byzcoll.PreconditionError, byzcoll.Error)
    comm.close()
    with pytest.raises(byzcoll.InvalidUsage, match="closed"):
        comm.barrier()


def test_result_lands_in_a_view_of_a_larger_array(world_of_one):
    big = np.arange(20, dtype=np.float64)
    view = big[5:15]
    report = world_of_one.robust_all_reduce(view, "trimmed-mean", 0)
    assert report.inputs == 1 and report.faults == []
    assert (big == np.arange(20)).all()  # a world of one aggregates to its own vector


def test_reduce_scatter_reads_a_read_only_input(world_of_one):
    x = np.arange(6, dtype=np.float64)
    x.flags.writeable = False
    out = np.zeros(6)
    report = world_of_one.robust_reduce_scatter(x, out, "median", 0)
    assert report.replicas == 1 and out.tolist() == list(range(6))


def test_torch_cpu_tensors_are_updated_in_place(world_of_one):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    t = torch.arange(8, dtype=torch.float32)
    ptr = t.data_ptr()
    world_of_one.robust_all_reduce(t, "median", 0)
    assert t.data_ptr() == ptr and t.tolist() == list(range(8))


def test_join_through_mpi4py_allgather_under_mpirun(tmp_path):
    if shutil.which("mpirun") is None or subprocess.run(
        [sys.executable, "-c", "import mpi4py"], capture_output=True
    ).returncode != 0:
        assert not os.environ.get("BYZCOLL_REQUIRE_MPI"), "BYZCOLL_REQUIRE_MPI is set but mpirun or mpi4py is missing"
        pytest.skip("mpirun or mpi4py missing")
    cmd = [
        "mpirun", "--allow-run-as-root", "--oversubscribe",
        "--mca", "oob_tcp_if_include", "lo", "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo",
        "-n", "3", sys.executable, WORKER, "mpi4py", "float32",
    ]
    prefix = f"{tmp_path}/rank"
    cmd[1:1] = ["-x", f"TEST_OUT_PREFIX={prefix}"]
    p = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    outs = []
    for r in range(3):
        with open(f"{prefix}{r}.json") as f:
            outs.append(json.load(f))
    assert sorted(o["rank"] for o in outs) == [0, 1, 2]
    for o in outs:
        assert o["median"] == 2.0 and o["inputs"] == 3 and o["faults"] == []


@pytest.mark.parametrize("rule,f,policy", [
    ("median", 2, "gather"),
    ("trimmed-mean", 2, "gather"),
    ("krum", 1, "gather"),
    ("median", 2, "sharded"),
    ("median", 2, "auto"),
])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_results_equal_the_rust_reference_bitwise(tmp_path, rule, f, policy, dtype):
    """Every rank's result equals, bit for bit, what `byzcoll aggregate` (the CPU rules the
    Rust API runs) makes of the same rows."""
    cli = os.environ.get("BYZCOLL_BIN")
    if not cli or not os.path.exists(cli):
        assert not os.environ.get("BYZCOLL_REQUIRE_MPI"), "BYZCOLL_BIN must name the byzcoll binary in CI"
        pytest.skip("BYZCOLL_BIN (the byzcoll CLI) is not set")
    n = 7
    rows = np.random.default_rng(7).standard_normal((n, 1001)).astype(dtype)
    rows[3] *= 1000  # one outlier row
    src, ref = tmp_path / "rows.npy", tmp_path / "ref.npy"
    np.save(src, rows)
    done = subprocess.run(
        [cli, "aggregate", "--rule", rule, "--f", str(f), str(src), "-o", str(ref)],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    expect = np.load(ref)
    run_job(n, f"rows:{rule}:{f}:{policy}:{src}:{tmp_path}/out", dtype)
    for r in range(n):
        got = np.load(tmp_path / f"out{r}.npy")
        assert got.dtype == expect.dtype
        # Sharded too: honest owners compute the same shard, and the median of identical
        # versions is that version.
        assert got.tobytes() == expect.tobytes(), f"rank {r} differs from the reference"


RSS_PROBE = r"""
import sys
import numpy as np
import byzcoll


def peak_rss():
    # VmHWM belongs to this process's memory (ru_maxrss would carry over the forking parent's).
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


mode, kind = sys.argv[1], sys.argv[2]
d = 16 << 20  # 64 MiB of float32
if kind == "torch":
    import torch

    x = torch.ones(d, dtype=torch.float32)
    address = x.data_ptr
else:
    x = np.ones(d, dtype=np.float32)
    address = lambda: x.__array_interface__["data"][0]
comm = byzcoll.init()
comm.robust_all_reduce(np.ones(8, dtype=np.float32), "median", 0)  # warm up
ptr = address()
reset_peak_rss()
before = peak_rss()
if mode == "copy":  # the control: what one copy of the array looks like
    y = np.array(x, copy=True)
    peak = 0
else:
    peak = comm.robust_all_reduce(x, "median", 0).peak_bytes
print(peak_rss() - before, peak, 4 * d, int(ptr == address()))
"""


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_no_copy_of_the_array_peak_rss(kind):
    """Peak RSS grows by what the collective reports holding (its own send and result buffers,
    report.peak_bytes), not by one more copy of the caller's 64 MiB array; the control shows
    that a copy is visible in the measure."""
    if kind == "torch":
        pytest.importorskip("torch", reason="torch is not installed")

    def probe(mode):
        env = clean_env(BYZCOLL_RANK="0", BYZCOLL_WORLD_SIZE="1")
        out = subprocess.run([sys.executable, "-c", RSS_PROBE, mode, kind], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return [int(v) for v in out.stdout.split()]

    grew, _, d, _ = probe("copy")
    assert grew >= 0.9 * d, f"the control copy of {d} bytes grew peak RSS by only {grew}"
    grew, peak, d, same = probe("call")
    assert same, "the result must land in the caller's buffer"
    assert peak <= 2 * d, f"the collective reports holding {peak} bytes"
    assert grew <= peak + d // 4, f"peak RSS grew by {grew} bytes, the collective holds {peak}: a copy of the {d}-byte array?"
