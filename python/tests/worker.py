"""One rank of the multi-process tests: joins the job, runs the scenario named on the command
line, prints one JSON line with what it saw."""

import json
import os
import sys

import numpy as np

import byzcoll


def main():
    scenario, dtype = sys.argv[1], np.dtype(sys.argv[2])
    if scenario == "mpi4py":
        comm = byzcoll.init_mpi4py(listen="127.0.0.1")
    else:
        comm = byzcoll.init()
    r, n = comm.rank, comm.size
    out = {"rank": r, "size": n}
    if scenario.startswith("rows:"):
        # rows:RULE:F:POLICY:INPUT.npy:OUTPUT_PREFIX — this rank contributes row r and writes
        # its result to OUTPUT_PREFIX<r>.npy.
        _, rule, f, policy, path, prefix = scenario.split(":")
        x = np.ascontiguousarray(np.load(path)[r])
        comm.robust_all_reduce(x, rule, int(f), policy=policy)
        np.save(f"{prefix}{r}.npy", x)
        comm.close()
        print(json.dumps(out), flush=True)
        return
    if scenario == "audited":
        # Sharded with one owner per shard, audited: every rank audits every other owner.
        x = np.arange(1000, dtype=dtype) + r
        report = comm.robust_all_reduce(x, "median", 1, policy="audited")
        out["result"] = x[:4].tolist()
        out["audit"] = report.audit
        out["replicas"] = report.replicas
        comm.close()
        print(json.dumps(out), flush=True)
        return
    if scenario == "straggler":
        # The last rank calls 1.5 s after the others; stragglers "auto" (s = 1 at 4 ranks).
        import time

        comm.set_stragglers("auto")
        # Under detect a communicator's first collective waits for every rank (they start apart): the
        # straggler is late in the second.
        comm.barrier()
        if r == n - 1:
            time.sleep(1.5)
        x = np.full(1000, r + 1, dtype=dtype)
        start = time.monotonic()
        report = comm.robust_all_reduce(x, "median", 1)
        out["seconds"] = time.monotonic() - start
        out["median"] = float(x[0])
        out["faults"] = report.faults
        out["stragglers"] = report.stragglers
        out["erased_self"] = report.erased_self
        out["health"] = comm.health()
        if r != n - 1:
            time.sleep(3)  # stay up while the straggler catches up
        comm.close()
        print(json.dumps(out), flush=True)
        return
    if scenario == "rejoin":
        # Under `byzcoll launch --restarts 1`: rank 3 exits at round 3 in its first life; the
        # others shrink and admit at every boundary (rounds 2, 4, 6, ...) and tell a rank they
        # admitted the round (a max all-reduce, where it contributes 0).
        rounds, rnd, events = 12, 0, []
        restarted = os.environ.get("BYZCOLL_REJOIN") == "1"
        if restarted:
            at = np.zeros(1)
            comm.all_reduce(at, "max")
            rnd = int(at[0])
            events.append(["rejoined", rnd, comm.job_ranks, comm.epoch])
        admitted_at = rnd if restarted else None
        while rnd < rounds:
            if rnd > 0 and rnd % 2 == 0 and rnd != admitted_at:
                comm = comm.shrink()
                for _ in range(300):
                    grown = comm.admit()
                    if grown is not None:
                        comm, ranks, epoch = grown
                        events.append(["admitted", rnd, ranks, epoch])
                        comm.all_reduce(np.full(1, float(rnd)), "max")
                    if comm.size == 4:
                        break
            if r == 3 and rnd == 3 and not restarted:
                sys.stdout.flush()
                os._exit(3)
            x = np.full(8, comm.job_ranks[comm.rank] + 1, dtype=dtype)
            report = comm.robust_all_reduce(x, "median", 1)
            events.append(["round", rnd, float(x[0]), comm.job_ranks, [f[0] for f in report.faults]])
            rnd += 1
        out["events"], out["job_ranks"] = events, comm.job_ranks
        comm.close()
        print(json.dumps(out), flush=True)
        return
    if scenario == "shrink":
        # Rank 2 leaves right after joining; the others shrink the communicator and go on.
        if r == 2:
            comm.close()
            print(json.dumps(out), flush=True)
            return
        sub = comm.shrink()
        out["new"] = [sub.rank, sub.size]
        x = np.full(8, r + 1, dtype=dtype)
        report = sub.robust_all_reduce(x, "median", 0)
        out["median"] = float(x[0])
        out["faults"] = report.faults
        sub.close()
        comm.close()
        print(json.dumps(out), flush=True)
        return
    if scenario == "out_of_step":
        # The last rank gives its call another step id: the others name it "out-of-step" and
        # return the median of their own inputs; it fails, naming them.
        comm.set_step(2 if r == n - 1 else 1)
        x = np.full(1000, r + 1, dtype=dtype)
        try:
            report = comm.robust_all_reduce(x, "median", 1)
            out["median"] = float(x[0])
            out["faults"] = report.faults
        except byzcoll.Error as e:
            out["error"] = type(e).__name__
            out["faults"] = e.faults
        comm.close()
        print(json.dumps(out), flush=True)
        return
    if scenario == "enforce":
        # Run under BYZCOLL_AGREEMENT=enforce: gather and sharded mode with the echo (the last
        # rank sends 1e9); reduce-scatter is refused up front. Every input is waited for: the
        # test counts the inputs and the steps, which a rank late on a loaded machine would
        # change (under Enforce even the first round may go on without one).
        comm.set_stragglers(0)
        x = np.full(1000, 1e9 if r == n - 1 else r + 1, dtype=dtype)
        report = comm.robust_all_reduce(x, "median", 1)
        out["median"] = float(x[0])
        out["uniform"] = bool((x == x[0]).all())
        out["inputs"] = report.inputs
        out["faults"] = report.faults
        out["erased_self"] = report.erased_self
        out["steps"] = len(report.step_times_us)
        y = np.full(1000, 1e9 if r == n - 1 else r + 1, dtype=dtype)
        sharded = comm.robust_all_reduce(y, "median", 1, policy="sharded")
        out["sharded"] = float(y[0])
        out["sharded_uniform"] = bool((y == y[0]).all())
        out["sharded_steps"] = len(sharded.step_times_us)
        try:
            comm.robust_reduce_scatter(
                np.ones(8, dtype=dtype), np.empty(2, dtype=dtype), "median", 1
            )
            out["reduce_scatter"] = "ran"
        except byzcoll.UnsupportedError as e:
            out["reduce_scatter"] = str(e)
        comm.close()
        print(json.dumps(out), flush=True)
        return
    x = np.full(1000, r + 1, dtype=dtype)
    liar = scenario == "byzantine" and r == n - 1
    if liar:
        x[:] = 1e9
    f = (n - 1) // 2
    before = x.__array_interface__["data"][0]
    report = comm.robust_all_reduce(x, "median", f)
    out["median"] = float(x[0])
    out["uniform"] = bool((x == x[0]).all())
    out["same_buffer"] = x.__array_interface__["data"][0] == before
    out["inputs"] = report.inputs
    out["faults"] = report.faults
    out["agreement"] = report.agreement
    out["identity"] = report.identity
    out["steps"] = len(report.step_times_us)
    out["bytes"] = (report.bytes_sent, report.bytes_received)
    out["outlying"] = report.outlying
    out["attribution"] = report.attribution
    out["health_scores"] = {h["rank"]: (h["outlying"], h["score"]) for h in comm.health()}
    y = np.full(1000, r + 1, dtype=dtype)
    comm.robust_all_reduce(y, "trimmed-mean", f, policy="sharded")
    out["trimmed_sharded"] = float(y[0])
    # Reduce-scatter: this rank's shard of the sharded all-reduce, bitwise; the input untouched.
    d = 1003
    z = (np.arange(d) % 17 + 3 * r).astype(dtype)
    full = z.copy()
    comm.robust_all_reduce(full, "median", f, policy="sharded")
    lo = r * (d // n) + min(r, d % n)
    shard = np.full(d // n + (r < d % n), np.nan, dtype=dtype)
    kept = z.copy()
    rs = comm.robust_reduce_scatter(z, shard, "median", f)
    out["reduce_scatter_matches"] = bool(np.array_equal(shard, full[lo : lo + len(shard)]))
    out["reduce_scatter_input_kept"] = bool(np.array_equal(z, kept))
    out["reduce_scatter_faults"] = rs.faults
    s = np.full(10, 1e9 if liar else r + 1, dtype=dtype)
    comm.all_reduce(s, "sum")
    out["sum"] = float(s[0])
    comm.barrier()
    comm.close()
    prefix = os.environ.get("TEST_OUT_PREFIX")
    if prefix:  # under mpirun, whose forwarding may join two ranks' lines into one
        with open(f"{prefix}{r}.json", "w") as f:
            json.dump(out, f)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
