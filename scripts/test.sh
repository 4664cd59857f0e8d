#!/usr/bin/env bash
# byzcoll's whole test suite. On a fresh Debian machine it first installs what the tests need
# (Open MPI's mpirun for the launcher-compatibility test), then checks formatting and lints,
# and runs every unit, conformance, multi-process and doc test, examples included.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=()
command -v mpirun >/dev/null 2>&1 || apt_packages+=(openmpi-bin)
command -v pgrep >/dev/null 2>&1 || apt_packages+=(procps)
if [ ${#apt_packages[@]} -gt 0 ]; then
    echo "== installing ${apt_packages[*]}"
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${apt_packages[@]}"
fi

# Tests fail, rather than skip, when a launcher they exercise is missing.
export BYZCOLL_REQUIRE_MPI=1

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --workspace 2>&1 | tee "$log"
# One closing line for the whole run (cargo prints one per test binary, the last often a doc-test
# crate with nothing in it).
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "total: %d passed, %d failed, %d skipped\n", p, f, i }' "$log"
