#!/usr/bin/env bash
# Checks the minimum supported Rust version, `rust-version` in Cargo.toml, two ways:
#   1. no package the lock file resolves for this platform declares a newer `rust-version`;
#   2. the workspace builds (`cargo check`, every target, default and all features) with that
#      toolchain, which rustup installs when it is missing (minimal profile, about 70 MB).
# (Clippy's `incompatible_msrv` lint, in `cargo clippy -D warnings`, also refuses std APIs
# newer than that version.)
#
# Usage: scripts/msrv.sh [FEATURES]   (FEATURES: the all-features list of scripts/test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

msrv=$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
if [ -z "$msrv" ]; then
    echo "msrv.sh: no rust-version in Cargo.toml" >&2
    exit 1
fi
host=$(rustc -vV | sed -n 's/^host: //p')

echo "== MSRV $msrv: the rust-version of every dependency resolved for $host"
cargo metadata --format-version 1 --locked --filter-platform "$host" |
    python3 -c '
import json, sys
msrv = sys.argv[1]
def version(v):
    parts = [int(x) for x in v.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))
meta = json.load(sys.stdin)
used = {node["id"] for node in meta["resolve"]["nodes"]}
newer = sorted(
    (p["name"], p["version"], p["rust_version"])
    for p in meta["packages"]
    if p["id"] in used and p.get("rust_version") and version(p["rust_version"]) > version(msrv)
)
for name, ver, rv in newer:
    print(f"  {name} {ver} needs rustc {rv}")
if newer:
    sys.exit(f"msrv.sh: {len(newer)} dependencies need a newer rustc than rust-version = {msrv}")
print(f"  {len(used)} packages, none needs more than {msrv}")
' "$msrv"

echo "== MSRV $msrv: cargo +$msrv check --workspace --all-targets (default, then all features)"
if ! rustup toolchain list | grep -q "^$msrv"; then
    rustup toolchain install "$msrv" --profile minimal
fi
cargo +"$msrv" check --workspace --all-targets --locked
if [ -n "${1:-}" ]; then
    cargo +"$msrv" check --workspace --all-targets --locked --features "$1"
fi
