#!/usr/bin/env bash
# byzcoll's whole test suite. On a fresh Debian machine it first installs what the tests need
# (Open MPI's mpirun and a one-node Slurm cluster for the launcher tests; UCX, libfabric,
# pkg-config and libclang for the UCX and libfabric transports), then checks formatting and lints,
# and runs every unit, conformance, multi-process and doc test, examples included: once with the
# default features (no system libraries) and once with `--features ucx,libfabric`.
set -euo pipefail
cd "$(dirname "$0")/.."

apt_packages=()
command -v mpirun >/dev/null 2>&1 || apt_packages+=(openmpi-bin)
command -v pgrep >/dev/null 2>&1 || apt_packages+=(procps)
command -v pkg-config >/dev/null 2>&1 || apt_packages+=(pkg-config)
pkg-config --exists ucx 2>/dev/null || apt_packages+=(libucx-dev)
command -v ucx_info >/dev/null 2>&1 || apt_packages+=(ucx-utils)
pkg-config --exists libfabric 2>/dev/null || apt_packages+=(libfabric-dev)
command -v fi_info >/dev/null 2>&1 || apt_packages+=(libfabric-bin)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || apt_packages+=(libclang-dev)
if [ ${#apt_packages[@]} -gt 0 ]; then
    echo "== installing ${apt_packages[*]}"
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${apt_packages[@]}"
fi

# Tests fail, rather than skip, when a launcher they exercise is missing.
export BYZCOLL_REQUIRE_MPI=1
# Keep UCX and libfabric's socket providers on loopback, and UCX quiet.
export UCX_NET_DEVICES=lo UCX_LOG_LEVEL=error
export FI_TCP_IFACE=lo FI_NET_IFACE=lo FI_SOCKETS_IFACE=lo FI_UDP_IFACE=lo

log=$(mktemp)
slurm_dir=$(mktemp -d /tmp/byzcoll-slurm.XXXXXX)
trap 'rm -f "$log"; scripts/slurm-down.sh "$slurm_dir"' EXIT
# A real one-node Slurm cluster for the srun tests.
SLURM_CONF=$(scripts/slurm-up.sh "$slurm_dir")
export SLURM_CONF BYZCOLL_REQUIRE_SLURM=1

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy (default features, then ucx and libfabric)"
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy --workspace --all-targets --features byzcoll/ucx,byzcoll/libfabric -- -D warnings
echo "== cargo test (default features: no system libraries)"
cargo test --workspace 2>&1 | tee -a "$log"
echo "== cargo test --features ucx,libfabric (UCX_TLS=tcp,self, FI_PROVIDER=tcp;ofi_rxm)"
UCX_TLS=tcp,self FI_PROVIDER="tcp;ofi_rxm" \
    cargo test --workspace --features byzcoll/ucx,byzcoll/libfabric 2>&1 | tee -a "$log"
echo "== shared-memory conformance: UCX_TLS=sm,self and FI_PROVIDER=shm"
UCX_TLS=sm,self cargo test -p byzcoll-transport-ucx --features ucx 2>&1 | tee -a "$log"
FI_PROVIDER=shm cargo test -p byzcoll-transport-libfabric --features libfabric 2>&1 | tee -a "$log"
# One closing line for the whole run (cargo prints one per test binary, the last often a doc-test
# crate with nothing in it).
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "total: %d passed, %d failed, %d skipped\n", p, f, i }' "$log"
