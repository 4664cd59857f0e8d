#!/usr/bin/env bash
# Python and C overhead side by side in one run: `robust_all_reduce` (median f = 1, gather, 4
# ranks) timed from Rust (examples/overhead.rs), from Python (python/bench/overhead.py) and from C
# (capi/bench/overhead.c, linked with libbyzcoll.a; skipped without a C compiler), in turn
# ROUNDS times (default 3) so that all see the same machine; then the DDP step with
# byzcoll's hook against gloo's all-reduce. Prints medians over the rounds, the ratio and the
# difference, and writes them as JSON to target/bench/python_overhead.json.
#
#   cargo build --release --bins --examples && cargo build --release -p byzcoll-capi
#   CARGO_TARGET_DIR=target/python pip install ./python    # into the venv of PYTHON
#   PYTHON=target/pyvenv/bin/python python/bench/overhead.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-target/pyvenv/bin/python}
rounds=${ROUNDS:-3}
launch() { target/release/byzcoll launch -n 4 -- "$@"; }
rows=$(mktemp)
c_bin=$(mktemp)
trap 'rm -f "$rows" "$c_bin"' EXIT
cc=${CC:-cc}
if command -v "$cc" >/dev/null && [ -f target/release/libbyzcoll.a ]; then
    "$cc" -O2 -Icapi/include capi/bench/overhead.c target/release/libbyzcoll.a -lpthread -ldl -lm -o "$c_bin"
else
    echo "# C skipped: no $cc, or no target/release/libbyzcoll.a (cargo build --release -p byzcoll-capi)"
    rm -f "$c_bin"
fi
for _ in $(seq "$rounds"); do
    launch target/release/examples/overhead --reps 15 | awk '$1 == "[0]" && $2 ~ /^[0-9]+$/ {print "rust", $2, $3}' >>"$rows"
    launch "$py" python/bench/overhead.py --port 0 --part allreduce |
        awk '$1 == "[0]" && $2 ~ /^[0-9]+$/ {print "python", $2, $3}' >>"$rows"
    if [ -x "$c_bin" ]; then
        launch "$c_bin" 15 | awk '$1 == "[0]" && $2 ~ /^[0-9]+$/ {print "c", $2, $3}' >>"$rows"
    fi
done
mkdir -p target/bench
"$py" - "$rows" target/bench/python_overhead.json <<'PY'
import json, statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for lang, size, ms in rows:
    by.setdefault((lang, int(size)), []).append(float(ms))
out = []
print(f"# robust_all_reduce, median f = 1, gather, 4 ranks: median of {len(by[('rust', 4096)])} runs (ms)")
has_c = any(lang == "c" for lang, _ in by)
print(f"{'bytes':>10} {'rust ms':>10} {'python ms':>10} {'ratio':>7} {'diff us':>9}"
      + (f" {'c ms':>10} {'ratio':>7} {'diff us':>9}" if has_c else ""))
for size in sorted({s for _, s in by}):
    r, p = statistics.median(by[("rust", size)]), statistics.median(by[("python", size)])
    line = f"{size:>10} {r:>10.3f} {p:>10.3f} {p / r:>7.2f} {(p - r) * 1e3:>9.0f}"
    row = {"bytes": size, "rust_ms": r, "python_ms": p, "ratio": p / r, "runs_rust": by[("rust", size)], "runs_python": by[("python", size)]}
    if has_c:
        c = statistics.median(by[("c", size)])
        line += f" {c:>10.3f} {c / r:>7.2f} {(c - r) * 1e3:>9.0f}"
        row.update({"c_ms": c, "c_ratio": c / r, "runs_c": by[("c", size)]})
    print(line)
    out.append(row)
json.dump({"bench": "python_overhead", "rows": out}, open(sys.argv[2], "w"), indent=1)
PY
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
launch "$py" python/bench/overhead.py --port "$port" --part ddp | sed -n 's/^\[0\] //p'
