"""Why byzcoll exists: data-parallel training of a small classifier (scikit-learn's digits, shipped
with the package) on 8 ranks, 2 of them Byzantine, with the gradients aggregated by the mean and
by robust rules.

    cargo build --release --bins
    target/release/byzcoll launch -n 8 -- python examples/python/train_under_attack.py \\
        --out results.json --plot results.png

Each rank trains on its shard; every step it contributes its gradient and gets back the aggregate
(`comm.robust_all_reduce`). The Byzantine ranks (the last two) are omniscient: they see every
honest gradient and send, by attack, the sign-flipped sum scaled by 10, ALIE (the honest mean
minus z standard deviations, coordinate-wise), or NaN. Rank 0 writes per-step loss and test
accuracy for every rule and attack as JSON, and a plot with --plot (matplotlib).

A straggler: `--straggler-ms MS` makes one honest rank (the third from last; `--slow-ranks K`:
the K honest ranks below the Byzantine ones) sleep MS before each step's all-reduce; `--stragglers auto` lets the rounds go on without it (quorum rounds,
`Communicator.set_stragglers`), `0` waits for it, and without the flag the library's default
holds (`auto`, none under `BYZCOLL_AGREEMENT=off`, or `BYZCOLL_STRAGGLERS`). Rank 0 prints each run's steps
per second.

Precision and device: `--dtype bfloat16` (or `float16`) trains the model in that type, so the
gradients travel as two bytes per element; `--device cuda` trains on the GPU, its gradients
staged through pinned host memory for each all-reduce.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

import byzcoll

ATTACKS = ["none", "sign-flip", "alie", "nan"]
RULES = ["mean", "median", "trimmed-mean", "krum"]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load(seed, dtype=torch.float32, device="cpu"):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=dtype, device=device)
    y = torch.tensor(y, device=device)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed)).to(device)
    x, y = x[order], y[order]
    split = int(0.8 * len(y))
    return (x[:split], y[:split]), (x[split:], y[split:])


def model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    return net.to(device=device, dtype=dtype)


def flat_grad(net, x, y):
    net.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def alie_z(n, f):
    """The z of "A Little Is Enough" (Baruch et al.): the largest deviation that still hides
    among the honest ranks."""
    s = n // 2 + 1 - f
    p = (n - s) / n
    # Inverse of the standard normal CDF by bisection (no scipy needed).
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return lo


def run(comm, rule, attack, steps, lr, train, test, byzantine, straggler_ms=0.0, slow_ranks=1):
    n, r = comm.size, comm.rank
    stragglers = range(n - len(byzantine) - slow_ranks, n - len(byzantine))
    x0 = train[0]
    net = model(x0.dtype, x0.device)
    (x, y), (xt, yt) = train, test
    shards = [(x[i::n], y[i::n]) for i in range(n)]
    f = len(byzantine)
    history = {"loss": [], "accuracy": []}
    comm.barrier()
    start = time.monotonic()
    for _ in range(steps):
        if r in byzantine and attack != "none":
            honest = torch.stack([flat_grad(net, *shards[i]) for i in range(n) if i not in byzantine])
            if attack == "sign-flip":
                g = -10.0 * honest.sum(0)
            elif attack == "alie":
                g = honest.mean(0) - alie_z(n, f) * honest.std(0)
            else:
                g = torch.full_like(honest[0], float("nan"))
        else:
            g = flat_grad(net, *shards[r])
        g = g.contiguous()
        if r in stragglers and straggler_ms > 0:
            time.sleep(straggler_ms / 1000)
        try:
            # The mean is the non-robust baseline: it tolerates no faulty rank (f = 0).
            comm.robust_all_reduce(g, rule, 0 if rule == "mean" else f)
        except byzcoll.FellBehindError:
            # This rank fell so far behind that the others went on without it: the step has
            # no aggregate here, so it is skipped (this rank's model then lags the others';
            # bringing it back in line, e.g. from a peer's state, is the application's call).
            history["fell_behind"] = history.get("fell_behind", 0) + 1
            continue
        except byzcoll.Error as e:
            # Every rank refuses alike (e.g. the mean of a NaN vector): the run stops here.
            history["error"] = str(e)
            break
        with torch.no_grad():
            offset = 0
            for p in net.parameters():
                p -= lr * g[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            out = net(xt)
            history["loss"].append(float(torch.nn.functional.cross_entropy(out, yt)))
            history["accuracy"].append(float((out.argmax(1) == yt).float().mean()))
    if x0.is_cuda:
        torch.cuda.synchronize()
    history["steps_per_second"] = len(history["loss"]) / (time.monotonic() - start)
    return history


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--out", default="train_under_attack.json")
    ap.add_argument("--plot", default=None, help="write a PNG of accuracy vs step per rule")
    ap.add_argument("--straggler-ms", type=float, default=0.0,
                    help="one honest rank sleeps this long before each step's all-reduce")
    ap.add_argument("--slow-ranks", type=int, default=1,
                    help="how many honest ranks (those just below the Byzantine ones) sleep --straggler-ms")
    ap.add_argument("--stragglers", default=None,
                    help='inputs a round may go without for lateness: "auto" or a count '
                         '(default: the library\'s, auto unless BYZCOLL_STRAGGLERS says)')
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                    help="the model's (and so the gradients') element type")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    if not 1 <= args.steps <= 100_000 or not (0 < args.lr < 100):
        sys.exit("--steps must be 1..100000 and --lr in (0, 100)")
    if not 0 <= args.straggler_ms <= 60_000:
        sys.exit("--straggler-ms must be 0..60000")
    rules, attacks = args.rules.split(","), args.attacks.split(",")
    for a in attacks:
        if a not in ATTACKS:
            sys.exit(f"unknown attack {a!r}; known: {', '.join(ATTACKS)}")
    torch.set_num_threads(1)
    comm = byzcoll.init()
    if comm.size < 4:
        sys.exit("run with at least 4 ranks (8 by default: byzcoll launch -n 8)")
    if not 1 <= args.slow_ranks <= comm.size - 3:
        sys.exit(f"--slow-ranks must be 1..{comm.size - 3} (the honest ranks but rank 0) in a world of {comm.size}")
    if args.stragglers is not None:
        comm.set_stragglers(args.stragglers)
    byzantine = {comm.size - 2, comm.size - 1}
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("BYZCOLL_LOCAL_RANK", "0")) % torch.cuda.device_count())
    train, test = load(seed=1, dtype=DTYPES[args.dtype], device=args.device)
    results = {}
    for rule in rules:
        for attack in attacks:
            h = run(comm, rule, attack, args.steps, args.lr, train, test, byzantine, args.straggler_ms,
                    args.slow_ranks)
            results.setdefault(rule, {})[attack] = h
            if h.get("fell_behind"):
                print(f"rank {comm.rank}, {rule} {attack}: fell behind, {h['fell_behind']} steps "
                      f"skipped of {args.steps}", flush=True)
            if comm.rank == 0:
                if "error" in h:
                    print(f"{rule:>13} {attack:>9}: refused after {len(h['loss'])} steps: {h['error']}", flush=True)
                else:
                    print(
                        f"{rule:>13} {attack:>9}: final accuracy {h['accuracy'][-1]:.3f}, "
                        f"loss {h['loss'][-1]:.3g}, {h['steps_per_second']:.1f} steps/s",
                        flush=True,
                    )
    comm.barrier()
    comm.close()
    if comm.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": comm.size, "byzantine": sorted(byzantine), "dtype": args.dtype,
                       "device": args.device, "results": results}, f)
        if args.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, axes = plt.subplots(1, len(attacks), figsize=(4 * len(attacks), 3.5), sharey=True)
            for ax, attack in zip(np.atleast_1d(axes), attacks):
                for rule in rules:
                    acc = np.nan_to_num(np.array(results[rule][attack]["accuracy"]))
                    ax.plot(acc, label=rule)
                ax.set_title(f"attack: {attack}")
                ax.set_xlabel("step")
                ax.set_ylim(0, 1)
            np.atleast_1d(axes)[0].set_ylabel("test accuracy")
            np.atleast_1d(axes)[0].legend()
            fig.suptitle(f"{comm.size} ranks, {len(byzantine)} Byzantine")
            fig.tight_layout()
            fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
