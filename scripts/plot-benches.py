#!/usr/bin/env python3
"""Draws the benches' JSON rows (target/bench/*.json, written by every bench next to its text
table) as PNG plots in docs/bench/, with an index (docs/bench/README.md) that shows them.

    cargo bench --bench collectives; cargo bench --bench aggregators     # any subset
    cp target/bench/collectives.json target/bench/collectives-8.json    # keep a run (8 ranks)
    scripts/bench-aggregate.sh; python/bench/overhead.sh
    target/pyvenv/bin/python scripts/plot-benches.py [--from target/bench] [--to docs/bench]

Needs matplotlib (the test command's virtual environment has it). A bench without rows is left
out of the index, with a line that says how to make them.
"""

import argparse
import json
import os
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HOW = {
    "collectives": "cargo bench --features ucx,libfabric --bench collectives",
    "p2p": "cargo bench --features ucx,libfabric --bench p2p",
    "aggregators": "cargo bench --bench aggregators",
    "aggregate_e2e": "scripts/bench-aggregate.sh",
    "python_overhead": "python/bench/overhead.sh",
}


def load(src, name):
    """The bench's rows: ``NAME.json``, and for the collectives also every ``NAME-*.json``
    (a run kept under another name, say ``collectives-8.json`` for 8 ranks); a list of
    documents, empty where there is none."""
    names = [f"{name}.json"]
    if name == "collectives":
        names += sorted(f for f in os.listdir(src) if f.startswith(f"{name}-") and f.endswith(".json"))
    docs = []
    for n in names:
        path = os.path.join(src, n)
        if os.path.exists(path):
            with open(path) as f:
                docs.append(json.load(f))
    return docs


def human(nbytes):
    for unit in ["B", "KiB", "MiB", "GiB"]:
        if nbytes < 1024:
            return f"{nbytes:g} {unit}"
        nbytes /= 1024
    return f"{nbytes:g} TiB"


def collectives(doc, dst):
    """Time and bus bandwidth against size, one panel per operation, byzcoll per transport and
    Open MPI's matching collectives on the same axes."""
    ranks = doc["meta"]["ranks"]
    panels = [
        ("all-reduce SUM", ["all_reduce"], ["MPI Allreduce"]),
        ("all-gather", ["all_gather"], ["MPI Allgather"]),
        (
            "robust median vs Open MPI Allreduce SUM, Allgather + median",
            [
                "robust_all_reduce gather",
                "robust_all_reduce sharded r=1",
                f"robust_all_reduce sharded r={2 * ((ranks - 1) // 2) + 1}",
                "robust_all_reduce audited r=1",
            ],
            ["MPI Allreduce", "MPI Allgather + numpy.median"],
        ),
    ]
    series = defaultdict(list)
    for r in doc["rows"]:
        who = r["collective"] if r["who"] == "Open MPI" else f"{r['collective']} ({r['transport']})"
        series[(r["collective"], r["who"], who)].append((r["bytes_per_rank"], r["seconds"]))
    fig, axes = plt.subplots(2, len(panels), figsize=(6 * len(panels), 9), squeeze=False)
    for col, (title, ours, theirs) in enumerate(panels):
        for (collective, who, label), points in sorted(series.items()):
            if collective not in (ours if who == "byzcoll" else theirs):
                continue
            points.sort()
            sizes = [p[0] for p in points]
            times = [p[1] * 1e6 for p in points]
            # Bytes each rank moves, as nccl-tests counts them for a ring all-reduce: the
            # same yardstick for every line, so lines compare as times do.
            busbw = [s * 2 * (ranks - 1) / ranks / t / 1e3 for s, t in zip(sizes, times)]
            style = dict(marker="o", linestyle="--" if who == "Open MPI" else "-")
            axes[0][col].plot(sizes, times, label=label, **style)
            axes[1][col].plot(sizes, busbw, label=label, **style)
        axes[0][col].set_title(title, fontsize=10)
        axes[0][col].set_ylabel("time (µs), slowest rank, median of reps")
        axes[1][col].set_ylabel("GB/s (bytes/rank x 2(n-1)/n / time)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bytes per rank")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][col].set_yscale("log")
        axes[0][col].legend(fontsize=7)
    fig.suptitle(f"collectives, {ranks} ranks on one host (loopback), same run")
    fig.tight_layout()
    png = f"collectives-{ranks}.png"
    fig.savefig(os.path.join(dst, png), dpi=90)
    plt.close(fig)
    return [(png, f"Collectives, {ranks} ranks: time and bandwidth against size, byzcoll per transport and Open MPI")]


# Each byzcoll configuration of the p2p bench and the anchor that runs the same library with the
# same settings (benches/p2p.rs): the anchor is drawn dashed in the configuration's colour.
P2P_ANCHORS = {
    "ucx-tcp": "perftest-tcp",
    "ucx-sm": "perftest-sm",
    "fi-tcp": "pingpong-tcp",
    "fi-shm": "pingpong-shm",
}


def p2p(doc, dst):
    """Point-to-point bandwidth against size per transport, each next to its anchor
    (ucx_perftest, fi_pingpong), and the one-way latency of 8 bytes."""
    bw = defaultdict(list)
    lat = {}
    for r in doc["rows"]:
        if r["kind"] == "bw":
            bw[r["config"]].append((r["bytes"], r["value"]))
        elif r["kind"] == "lat":
            lat[r["config"]] = r["value"]
    ours = [c for c in ["tcp", "ucx-tcp", "ucx-sm", "fi-tcp", "fi-shm"] if c in bw or c in lat]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [2, 1]})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, config in enumerate(ours):
        colour = colours[i % len(colours)]
        for label, dashed in [(config, False), (P2P_ANCHORS.get(config), True)]:
            points = sorted(bw.get(label, [])) if label else []
            if not points:
                continue
            name = f"{label} (anchor)" if dashed else f"{label} (byzcoll)"
            left.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=colour,
                      linestyle="--" if dashed else "-", label=name)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("message bytes")
    left.set_ylabel("MiB/s")
    left.set_title("bandwidth (byzcoll solid, the same library's own tool dashed)", fontsize=10)
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7)
    labels, values, bar_colours = [], [], []
    for i, config in enumerate(ours):
        for label in [config, P2P_ANCHORS.get(config)]:
            if label in lat:
                labels.append(label)
                values.append(lat[label])
                bar_colours.append(colours[i % len(colours)])
    right.barh(labels, values, color=bar_colours)
    right.invert_yaxis()
    right.set_xscale("log")
    right.set_xlabel("one-way latency of 8 bytes (us)")
    right.set_title("latency", fontsize=10)
    right.grid(True, axis="x", which="both", alpha=0.3)
    fig.suptitle("point to point, two ranks on one host (loopback or shared memory), same run")
    fig.tight_layout()
    fig.savefig(os.path.join(dst, "p2p.png"), dpi=90)
    plt.close(fig)
    return [("p2p.png", "Point to point: byzcoll per transport against ucx_perftest and fi_pingpong")]


def aggregators(doc, dst):
    """Time per rule, byzcoll (per thread count) next to numpy/scipy, one panel per n."""
    by_n = defaultdict(list)
    for r in doc["rows"]:
        by_n[r["n"]].append(r)
    ns = sorted(by_n)
    fig, axes = plt.subplots(1, len(ns), figsize=(7 * len(ns), 5), squeeze=False)
    for ax, n in zip(axes[0], ns):
        rows = by_n[n]
        rules = list(dict.fromkeys(r["rule"] for r in rows))
        threads = list(dict.fromkeys(r["threads"] for r in rows))
        width = 0.8 / len(threads)
        for k, t in enumerate(threads):
            xs, ys = [], []
            for i, rule in enumerate(rules):
                match = [r for r in rows if r["rule"] == rule and r["threads"] == t]
                if match:
                    xs.append(i + k * width)
                    ys.append(match[0]["seconds"] * 1e3)
            label = "numpy/scipy" if t == "numpy" else f"byzcoll, {t} thread(s)"
            ax.bar(xs, ys, width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rules))])
        ax.set_xticklabels(rules, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"n = {n} inputs of d = {doc['meta']['d']} float32")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(dst, "aggregators.png"), dpi=90)
    plt.close(fig)
    return [("aggregators.png", "Aggregation rules against numpy/scipy, in memory")]


def paired_bars(doc, dst, name, key, pairs, ylabel, title):
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(pairs)
    for k, (field, label) in enumerate(pairs):
        ax.bar([i + k * width for i in range(len(rows))], [r[field] for r in rows], width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax.set_xticklabels([key(r) for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(dst, f"{name}.png"), dpi=90)
    plt.close(fig)


def aggregate_e2e(doc, dst):
    for r in doc["rows"]:
        r["byzcoll_ms"], r["numpy_ms"] = r["byzcoll_s"] * 1e3, r["numpy_s"] * 1e3
    paired_bars(
        doc, dst, "aggregate_e2e", lambda r: r["rule"],
        [("byzcoll_ms", "byzcoll aggregate"), ("numpy_ms", "numpy/scipy (np.load, rule, np.save)")],
        "wall time (ms)", f"byzcoll aggregate end to end, n = {doc['n']}, d = {doc['d']} float32",
    )
    return [("aggregate_e2e.png", "`byzcoll aggregate` end to end against numpy/scipy")]


def python_overhead(doc, dst):
    paired_bars(
        doc, dst, "python_overhead", lambda r: human(r["bytes"]),
        [("rust_ms", "from Rust"), ("python_ms", "from Python")],
        "time (ms)", "robust_all_reduce (median f = 1, gather, 4 ranks) from Rust and from Python",
    )
    return [("python_overhead.png", "Python against Rust, the same robust all-reduce")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="src", default="target/bench")
    ap.add_argument("--to", dest="dst", default="docs/bench")
    args = ap.parse_args()
    os.makedirs(args.dst, exist_ok=True)
    index = ["# Benchmarks", "", "Drawn by `scripts/plot-benches.py` from the JSON rows the benches write to",
             "`target/bench/`; figures from one 2-core VM over loopback (compare within a plot, not",
             "across machines). [PROFILE.md](PROFILE.md): where the collectives' time goes, next to Open MPI.",
             ""]
    for name, draw in [("collectives", collectives), ("p2p", p2p), ("aggregators", aggregators),
                       ("aggregate_e2e", aggregate_e2e), ("python_overhead", python_overhead)]:
        docs = load(args.src, name)
        if not docs:
            index += [f"- {name}: no rows yet (`{HOW[name]}`)", ""]
            continue
        # One plot per document; of documents that would draw the same file (two collectives
        # runs at one world size) the last in name order wins.
        drawn = {}
        for doc in docs:
            for png, caption in draw(doc, args.dst):
                drawn[png] = caption
        for png, caption in sorted(drawn.items()):
            index += [f"## {caption}", "", f"`{HOW[name]}`", "", f"![{caption}]({png})", ""]
    with open(os.path.join(args.dst, "README.md"), "w") as f:
        f.write("\n".join(index))
    print(f"wrote {args.dst}/README.md")


if __name__ == "__main__":
    main()
