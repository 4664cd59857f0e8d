"""PyTorch anchor for gpu/benches/kernels.rs: the CUDA rules' torch equivalents on the same data.

Run by the benchmark once per run (or by hand, on a machine with a CUDA GPU and torch):

    python3 benches/anchors/torch_aggregators.py --n 8,16,32,64,128 --exp 25 \\
        --rules median,trimmed-mean,krum --json

For each n it generates x, n float32 vectors of length d = 2^exp, on the GPU, bitwise the data
the Rust benchmark generates (the hash formula below, in torch int64 arithmetic), and times with
CUDA events after warm-up (the median of --iters calls is reported):

    median        torch.median(x, dim=0)                           f = n // 4 (not used by torch)
    trimmed-mean  torch.sort(x, dim=0).values[f:n-f].mean(dim=0)   f = n // 4
    krum          D = torch.cdist(x, x) ** 2; the score of i is the sum of its n - f - 2 smallest
                  distances to the others (topk of n - f - 1 with the zero diagonal included);
                  x[argmin(score)]                                  f = n // 4 (n > 2f + 2)

For --check-n it also returns, over the coordinates [check-start, check-start + check-count):
torch.median (the lower middle value for even n), the midpoint median the CUDA rule computes
((lo + hi) / 2 in float64, rounded to float32), the sort-based trimmed mean, Krum's selected
index, a few generated values (so the benchmark can confirm both sides hold the same data), and
how many coordinates torch.median makes NaN when input 0 is NaN there.

--self-check needs only numpy (no torch, no GPU): it prints the formula's values at fixed
indices and bit sums over index ranges, for comparison with
`cargo bench -p byzcoll-cuda --bench kernels -- --self-check`.

The data formula, for the flat index i = row * d + col (64-bit):
    mix(x):  x ^= x >> 16; x = x * 0x7feb352d mod 2^32; x ^= x >> 15;
             x = x * 0x31848bab mod 2^32; x ^= x >> 16
    h = mix((i mod 2^32) ^ mix((i >> 32) ^ 0x5EED))
    value = (h >> 8) * 2^-23 - 1        (exact in float32, in [-1, 1))
Both multipliers are below 2^31, so x * m < 2^63 never overflows int64.
"""
import argparse
import json
import sys
import time

SEED = 0x5EED
MUL1 = 0x7FEB352D
MUL2 = 0x31848BAB
MASK = 0xFFFFFFFF
# Indices printed by --self-check (the Rust side prints the same list).
SAMPLE_INDICES = [0, 1, 2, 12345, 2**25 - 1, 2**25, 16 * 2**25 - 1, 2**32 - 1, 2**32, 2**32 + 7,
                  2**40 + 3]
# Index ranges whose float32 bit patterns are summed by --self-check: [start, start + len).
BIT_SUM_RANGES = [(0, 2**20), (2**32 - 2**19, 2**20)]


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def parse_list(text, what, conv=int):
    try:
        values = [conv(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be a comma-separated list")
    if not values:
        raise argparse.ArgumentTypeError(f"{what} must not be empty")
    return values


def mix(x):
    """The 32-bit mixer on non-negative integers below 2^32 (numpy uint64 or torch int64)."""
    x = x ^ (x >> 16)
    x = (x * MUL1) & MASK
    x = x ^ (x >> 15)
    x = (x * MUL2) & MASK
    return x ^ (x >> 16)


def values_numpy(np, i):
    """The generated float32 values at flat indices i (a numpy uint64 array)."""
    i = i.astype(np.uint64)
    lo = i & np.uint64(MASK)
    hi = i >> np.uint64(32)
    h = mix(lo ^ mix(hi ^ np.uint64(SEED)))
    return (h >> np.uint64(8)).astype(np.float32) * np.float32(2.0**-23) - np.float32(1.0)


def values_torch(torch, i):
    """The generated float32 values at flat indices i (a torch int64 tensor)."""
    lo = i & MASK
    hi = i >> 32
    h = mix(lo ^ mix(hi ^ SEED))
    return (h >> 8).to(torch.float32) * (2.0**-23) - 1.0


def self_check():
    import numpy as np

    idx = np.array(SAMPLE_INDICES, dtype=np.uint64)
    vals = values_numpy(np, idx)
    print("# byzcoll bench data formula (numpy)")
    for i, v in zip(SAMPLE_INDICES, vals):
        print(f"value[{i}] = {float(v):.9g} bits={int(v.view(np.uint32)):08x}")
    for start, length in BIT_SUM_RANGES:
        total = 0
        step = 1 << 20
        for s in range(start, start + length, step):
            chunk = np.arange(s, min(s + step, start + length), dtype=np.uint64)
            total += int(values_numpy(np, chunk).view(np.uint32).astype(np.uint64).sum())
        print(f"bitsum[{start}..{start + length}) = {total}")
    try:
        import torch
    except ImportError:
        print("# torch not importable: torch formula not checked")
        return 0
    tvals = values_torch(torch, torch.tensor(SAMPLE_INDICES, dtype=torch.int64))
    same = bool((tvals.numpy().view(np.uint32) == vals.view(np.uint32)).all())
    print(f"# torch (CPU) formula equals numpy bitwise at the sample indices: {same}")
    return 0 if same else 1


def generate(torch, n, d, device):
    x = torch.empty((n, d), dtype=torch.float32, device=device)
    col = torch.arange(d, dtype=torch.int64, device=device)
    for r in range(n):
        x[r] = values_torch(torch, col + r * d)
    return x


def krum_select(torch, x, f):
    n = x.shape[0]
    dist = torch.cdist(x, x) ** 2
    scores = dist.topk(n - f - 1, dim=1, largest=False).values.sum(dim=1)
    return scores.argmin()


def rule_op(torch, rule, x, f):
    n = x.shape[0]
    if rule == "median":
        return lambda: torch.median(x, dim=0)
    if rule == "trimmed-mean":
        return lambda: torch.sort(x, dim=0).values[f:n - f].mean(dim=0)
    if rule == "krum":
        return lambda: x[krum_select(torch, x, f)].clone()
    raise ValueError(f"no torch equivalent for rule {rule!r} (median, trimmed-mean, krum)")


def timed(torch, op, warmup, iters, cuda):
    for _ in range(warmup):
        op()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            op()
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])


def finite_list(t):
    return [float(v) if v == v and abs(v) != float("inf") else None for v in t.tolist()]


def check(torch, x, f, start, count, krum_index):
    n = x.shape[0]
    s = x[:, start:start + count]
    ordered = torch.sort(s, dim=0).values
    lo, hi = ordered[(n - 1) // 2], ordered[n // 2]
    mid = (lo.double() * 0.5 + hi.double() * 0.5).float()
    trimmed = ordered[f:n - f].mean(dim=0)
    sample_cols = [0, 1, count // 2, count - 1]
    samples = [[r * x.shape[1] + start + c, float(s[r, c])] for r in (0, n - 1) for c in sample_cols]
    poisoned = s.clone()
    poisoned[0] = float("nan")
    nan_median = torch.median(poisoned, dim=0).values
    return {
        "n": n,
        "f": f,
        "start": start,
        "count": count,
        "median_lower": finite_list(torch.median(s, dim=0).values),
        "median_mid": finite_list(mid),
        "trimmed_mean": finite_list(trimmed),
        "krum_selected": krum_index,
        "samples": samples,
        "nan_row0_median_nan": int(torch.isnan(nan_median).sum()),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=lambda t: parse_list(t, "--n"), default=[8, 16, 32, 64, 128])
    p.add_argument("--exp", type=int, default=25, help="d = 2^exp")
    p.add_argument("--rules", type=lambda t: parse_list(t, "--rules", str),
                   default=["median", "trimmed-mean", "krum"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--check-n", type=int, default=None, help="n of the result check (default 16 if listed)")
    p.add_argument("--check-start", type=int, default=None, help="first coordinate (default d / 2 + 1)")
    p.add_argument("--check-count", type=int, default=4096)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--self-check", action="store_true", help="numpy only: print formula values")
    p.add_argument("--device", default="cuda",
                   help="cuda (default), or cpu to test this script's logic (host clock, slow)")
    args = p.parse_args()
    if args.self_check:
        return self_check()

    def emit(obj):
        if args.json:
            print(json.dumps(obj, allow_nan=False), flush=True)
        else:
            print(json.dumps(obj, indent=1, allow_nan=False), flush=True)

    try:
        import torch
    except ImportError as e:
        emit({"available": False, "reason": f"torch not importable ({e})"})
        return 0
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        emit({"available": False, "reason": f"torch {torch.__version__} sees no CUDA device"})
        return 0
    device = torch.device(args.device)
    d = 1 << args.exp
    check_n = args.check_n if args.check_n is not None else (16 if 16 in args.n else args.n[0])
    start = args.check_start if args.check_start is not None else d // 2 + 1
    count = max(1, min(args.check_count, d - start))
    results, checked = [], None
    for n in args.n:
        f = n // 4
        log(f"# torch: n = {n}, d = 2^{args.exp}: generating")
        x = generate(torch, n, d, device)
        for rule in args.rules:
            if rule == "krum" and not n > 2 * f + 2:
                continue
            ms = timed(torch, rule_op(torch, rule, x, f), args.warmup, args.iters, cuda)
            log(f"# torch: n = {n} {rule}: {ms:.3f} ms")
            results.append({"n": n, "rule": rule, "f": f, "ms": ms, "iters": args.iters})
        if n == check_n:
            krum_index = int(krum_select(torch, x, f)) if n > 2 * f + 2 else None
            checked = check(torch, x, f, start, count, krum_index)
        del x
        if cuda:
            torch.cuda.empty_cache()
    emit({
        "available": True,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "timer": "cuda events" if cuda else "host clock",
        "exp": args.exp,
        "warmup": args.warmup,
        "results": results,
        "check": checked,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
