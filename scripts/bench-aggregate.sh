#!/usr/bin/env bash
# `byzcoll aggregate` end to end (read the .npy, aggregate, write the result) against numpy/scipy
# doing the same from Python (np.load, the rule, np.save), in one run, alternating REPS times
# (default 5): wall time and peak RSS (/usr/bin/time), medians, and their ratios. The input is
# n = 16 rows of d = 2^22 float32 (256 MiB), made once under target/bench/. Writes the rows as
# JSON to target/bench/aggregate_e2e.json.
#
#   cargo build --release --bins
#   PYTHON=target/pyvenv/bin/python scripts/bench-aggregate.sh      # needs numpy and scipy
#
# BYZCOLL (default target/release/byzcoll) names the binary to time, e.g. an older build.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
bin=${BYZCOLL:-target/release/byzcoll}
reps=${REPS:-5}
mkdir -p target/bench
input=target/bench/aggregate_16x4M.npy
[ -f "$input" ] || "$py" -c "
import numpy as np
np.save('$input', np.random.default_rng(0).standard_normal((16, 1 << 22), dtype=np.float32))"
rows=$(mktemp)
trap 'rm -f "$rows" target/bench/aggregate_out.npy' EXIT
timed() { /usr/bin/time -f "%e %M" "$@" 2>&1 >/dev/null | tail -1; }
for _ in $(seq "$reps"); do
    for rule in median trimmed-mean krum; do
        echo "byzcoll $rule $(timed "$bin" aggregate --rule "$rule" --f 3 "$input" -o target/bench/aggregate_out.npy)" >>"$rows"
        echo "numpy $rule $(timed "$py" -c "
import sys, numpy as np
x = np.load('$input')
rule, f = sys.argv[1], 3
if rule == 'median':
    out = np.median(x, axis=0)
elif rule == 'trimmed-mean':
    from scipy.stats import trim_mean
    out = trim_mean(x, f / len(x), axis=0)
else:  # Krum: the row with the smallest sum of squared distances to its n - f - 2 nearest
    g = x.astype(np.float64) @ x.T.astype(np.float64)
    sq = np.diag(g)
    dist = sq[:, None] + sq[None, :] - 2 * g
    scores = np.sort(dist, axis=1)[:, 1 : len(x) - f - 1].sum(axis=1)
    out = x[np.argmin(scores)]
np.save('target/bench/aggregate_out.npy', out.astype(np.float32))
" "$rule")" >>"$rows"
    done
done
"$py" - "$rows" target/bench/aggregate_e2e.json "$bin" <<'PY'
import json, statistics, sys
by = {}
for line in open(sys.argv[1]):
    who, rule, secs, kib = line.split()
    by.setdefault((who, rule), []).append((float(secs), int(kib)))
print(f"# {sys.argv[3]} aggregate vs numpy/scipy end to end, n = 16, d = 2^22 float32 (256 MiB), "
      f"median of {len(by[('byzcoll', 'median')])} runs")
print(f"{'rule':>13} {'byzcoll s':>10} {'numpy s':>8} {'speed-up':>9} {'byzcoll MiB':>12} {'numpy MiB':>10}")
rows = []
for rule in ["median", "trimmed-mean", "krum"]:
    b, n = by[("byzcoll", rule)], by[("numpy", rule)]
    bt, nt = statistics.median(t for t, _ in b), statistics.median(t for t, _ in n)
    bm, nm = max(m for _, m in b) / 1024, max(m for _, m in n) / 1024
    print(f"{rule:>13} {bt:>10.3f} {nt:>8.3f} {nt / bt:>9.1f} {bm:>12.0f} {nm:>10.0f}")
    rows.append({"rule": rule, "byzcoll_s": bt, "numpy_s": nt, "speedup": nt / bt, "byzcoll_peak_mib": bm, "numpy_peak_mib": nm})
json.dump({"bench": "aggregate_e2e", "n": 16, "d": 1 << 22, "rows": rows}, open(sys.argv[2], "w"), indent=1)
PY
