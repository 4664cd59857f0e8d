"""numpy/scipy anchor for benches/aggregators.rs: the same rules on same-shaped data.

Run by the benchmark (or by hand):

    python3 benches/anchors/numpy_aggregators.py --n 4,16 --exp 22 --rules mean,median,krum

For each n it builds n float32 vectors of length d = 2^exp (a common N(0, 1) vector plus
0.1 * N(0, 1) noise per vector, seeded; same shape and distribution as the Rust bench, not
bitwise the same data) and times, single-threaded:

    mean          numpy.mean(x, axis=0)
    median        numpy.median(x, axis=0)                       f = (n - 1) // 2
    trimmed-mean  scipy.stats.trim_mean(x, f / n, axis=0)       f = (n - 1) // 2, trims f per end
    krum          pairwise squared distances in the difference form, float64 accumulation,
                  score = sum of the n - f - 2 smallest distances to the others, argmin
                                                                f = (n - 3) // 2 (n > 2f + 2)
    multi-krum    krum's scores, mean of the m = n - f best-scored vectors

The distances are computed over column blocks of 8192 coordinates, upper triangle only, with
preallocated temporaries: about 4x faster than `((x - x[i])**2).sum(axis=1)` over whole rows.

Timing: one warm-up call, then reps until at least 3 reps and 1 s (at most 20); the median is
reported. Results are printed as `RESULT n=16 rule=median f=7 seconds=0.123 reps=5`; every other
line starts with '#'.
"""
import argparse
import sys
import time

SEED = 0x5EED
BLOCK = 8192


def parse_list(text, what):
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be a comma-separated list of integers")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{what} must list integers >= 1")
    return values


def timed(op):
    op()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < 20 and (len(times) < 3 or time.perf_counter() - start < 1.0):
        t = time.perf_counter()
        op()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2], len(times)


def pairwise_sq_distances(np, x):
    """Squared Euclidean distances between the rows of x, difference form, float64 sums."""
    n, d = x.shape
    dist = np.zeros((n, n))
    buf = np.empty((max(n - 1, 1), BLOCK), dtype=x.dtype)
    for s in range(0, d, BLOCK):
        xb = x[:, s:s + BLOCK]
        w = xb.shape[1]
        for i in range(n - 1):
            diff = np.subtract(xb[i + 1:], xb[i], out=buf[:n - 1 - i, :w])
            np.square(diff, out=diff)
            dist[i, i + 1:] += diff.sum(axis=1, dtype=np.float64)
    return dist + dist.T


def krum_scores(np, x, f):
    n = x.shape[0]
    dist = pairwise_sq_distances(np, x)
    k = n - f - 2
    scores = np.empty(n)
    for i in range(n):
        others = np.delete(dist[i], i)
        scores[i] = np.partition(others, k - 1)[:k].sum() if k > 0 else 0.0
    return scores


def krum(np, x, f):
    return x[int(np.argmin(krum_scores(np, x, f)))].copy()


def multi_krum(np, x, f):
    m = x.shape[0] - f
    best = np.argsort(krum_scores(np, x, f), kind="stable")[:m]
    return x[np.sort(best)].mean(axis=0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=lambda t: parse_list(t, "--n"), default=[4, 8, 16, 32, 64])
    p.add_argument("--exp", type=int, default=22)
    p.add_argument("--rules", default="mean,median,trimmed-mean,krum,multi-krum")
    a = p.parse_args()
    if not 0 <= a.exp <= 30:
        p.error("--exp must be in 0..=30")
    rules = [r for r in a.rules.split(",") if r]

    try:
        import numpy as np
    except ImportError:
        print("# numpy anchor not run: numpy is missing; pip install numpy scipy", flush=True)
        return 0
    try:
        import scipy
        import scipy.stats
    except ImportError:
        scipy = None
        print("# scipy is missing (no trimmed-mean anchor); pip install numpy scipy", flush=True)

    print(f"# numpy {np.__version__}, scipy {scipy.__version__ if scipy else '-'}, "
          f"python {sys.version.split()[0]}; single-threaded", flush=True)

    d = 1 << a.exp
    for n in a.n:
        rng = np.random.default_rng([SEED, n])
        x = rng.standard_normal((n, d), dtype=np.float32)
        x *= np.float32(0.1)
        x += rng.standard_normal(d, dtype=np.float32)
        coord_f = (n - 1) // 2
        krum_f = (n - 3) // 2
        ops = {
            "mean": (0, lambda: np.mean(x, axis=0)),
            "median": (coord_f, lambda: np.median(x, axis=0)),
        }
        if scipy is not None:
            # int(prop * n) must be exactly f: nudge up past any rounding below f / n.
            prop = coord_f / n
            while int(prop * n) < coord_f:
                prop = float(np.nextafter(prop, 1.0))
            ops["trimmed-mean"] = (coord_f, lambda: scipy.stats.trim_mean(x, prop, axis=0))
        if n > 2 * krum_f + 2 and krum_f >= 0:
            ops["krum"] = (krum_f, lambda: krum(np, x, krum_f))
            ops["multi-krum"] = (krum_f, lambda: multi_krum(np, x, krum_f))
        for rule in rules:
            if rule not in ops:
                continue
            f, op = ops[rule]
            seconds, reps = timed(op)
            print(f"RESULT n={n} rule={rule} f={f} seconds={seconds:.6g} reps={reps}", flush=True)
        del x
    return 0


if __name__ == "__main__":
    sys.exit(main())
