#!/usr/bin/env bash
# byzcoll's whole test suite. On a fresh Debian machine it first installs what the tests need
# (scripts/deps.sh says what is missing: Open MPI with mpicc, a one-node Slurm cluster for the
# launcher tests, UCX, libfabric, pkg-config and libclang for those transports, a C++ compiler),
# then checks formatting and lints, and runs every unit, conformance, multi-process, C ABI and doc
# test, examples included: once with the default features (no system libraries) and once with
# `--features ucx,libfabric,cuda,nccl`; then builds the Python package into a virtual environment
# (target/pyvenv: maturin, numpy, pytest, mpi4py, torch) and runs its tests.
# There is no GPU in CI: the CUDA kernels are compiled for sm_90 by NVRTC (the nvidia-cuda-nvrtc
# wheel, installed below), run under the CPU emulation of byzcoll-cuda-emu, and the GPU tests
# print SKIPPED (counted in the closing line).
set -euo pipefail
cd "$(dirname "$0")/.."

mapfile -t apt_packages < <(scripts/deps.sh)
if [ ${#apt_packages[@]} -gt 0 ]; then
    echo "== installing ${apt_packages[*]}"
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${apt_packages[@]}"
    still=$(scripts/deps.sh | tr '\n' ' ')
    if [ -n "$still" ]; then
        echo "installed, but still missing what they should bring: $still" >&2
        exit 1
    fi
fi

# NVRTC for the kernel compile test: the CUDA toolkit's if there is one, else the PyPI wheel
# (CUDA 13.0, the version byzcoll-cuda binds to by default).
nvrtc_dir=${BYZCOLL_NVRTC_DIR:-/opt/byzcoll-nvrtc}
if ! ldconfig -p | grep -q 'libnvrtc\.so' && [ ! -e "$nvrtc_dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    echo "== installing NVRTC (pip nvidia-cuda-nvrtc 13.0) into $nvrtc_dir"
    python3 -m pip install -q --no-cache-dir --disable-pip-version-check --target "$nvrtc_dir" "nvidia-cuda-nvrtc==13.0.*"
fi
export LD_LIBRARY_PATH="$nvrtc_dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export BYZCOLL_REQUIRE_NVRTC=1

# Tests fail, rather than skip, when a launcher they exercise is missing.
export BYZCOLL_REQUIRE_MPI=1
# Keep UCX and libfabric's socket providers on loopback, and UCX quiet.
export UCX_NET_DEVICES=lo UCX_LOG_LEVEL=error
export FI_TCP_IFACE=lo FI_NET_IFACE=lo FI_SOCKETS_IFACE=lo FI_UDP_IFACE=lo

# Disk: CI machines have had little free (one run of this suite failed with "No space left on
# device" while linking). Line tables only (enough for backtraces with file and line) and no
# incremental cache keep a clean run's target/debug to about 3.3 GiB, where full debug info and
# incremental caches took 5.6 GiB for the default-features pass alone.
export CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=line-tables-only
echo "== disk: $(df -h --output=avail . | tail -n 1 | tr -d ' ') free where target/ is"

log=$(mktemp)
slurm_dir=$(mktemp -d /tmp/byzcoll-slurm.XXXXXX)
trap 'rm -f "$log"; scripts/slurm-down.sh "$slurm_dir"' EXIT
# A real one-node Slurm cluster for the srun tests.
SLURM_CONF=$(scripts/slurm-up.sh "$slurm_dir")
export SLURM_CONF BYZCOLL_REQUIRE_SLURM=1

echo "== cargo fmt --check"
cargo fmt --all -- --check
all_features=byzcoll/ucx,byzcoll/libfabric,byzcoll/cuda,byzcoll/nccl,byzcoll-cli/ucx,byzcoll-cli/libfabric,byzcoll-cli/cuda,byzcoll-cli/nccl,byzcoll-capi/cuda
echo "== cargo clippy (default features, then ucx, libfabric, cuda and nccl)"
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy --workspace --all-targets --features "$all_features" -- -D warnings
echo "== cargo doc --no-deps (warnings denied: broken links, missing docs), default and all features"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --features "$all_features"
echo "== MSRV (scripts/msrv.sh): dependencies' rust-version, and cargo check with that toolchain"
scripts/msrv.sh "$all_features"
echo "== cargo check of the fuzz targets (fuzz/, its own workspace)"
cargo check --manifest-path fuzz/Cargo.toml --bins
echo "== cargo check with CUDA 12 bindings (the cuda-12 feature)"
cargo check -p byzcoll --no-default-features --features tcp,cuda-12,cuda,nccl --all-targets
echo "== cargo check of the library alone, without the TCP transport (no default features)"
cargo check -p byzcoll --no-default-features
echo "== cargo test (default features: no system libraries)"
cargo test --workspace 2>&1 | tee -a "$log"
echo "== cargo test --features ucx,libfabric,cuda,nccl (UCX_TLS=tcp,self, FI_PROVIDER=tcp;ofi_rxm)"
# byzcoll-cuda's emulated-kernel tests do not depend on these features and ran above; its
# NCCL device-vector tests (which skip without a GPU) do.
UCX_TLS=tcp,self FI_PROVIDER="tcp;ofi_rxm" \
    cargo test --workspace --exclude byzcoll-cuda --exclude byzcoll-cuda-emu \
    --features "$all_features" 2>&1 | tee -a "$log"
cargo test -p byzcoll-cuda --features nccl --test device_exchange 2>&1 | tee -a "$log"
cargo test -p byzcoll-cuda --features nccl --test device nccl 2>&1 | tee -a "$log"
echo "== shared-memory conformance: UCX_TLS=sm,self and FI_PROVIDER=shm"
UCX_TLS=sm,self cargo test -p byzcoll-transport-ucx --features ucx 2>&1 | tee -a "$log"
FI_PROVIDER=shm cargo test -p byzcoll-transport-libfabric --features libfabric 2>&1 | tee -a "$log"
# The Python package (python/, its own cargo workspace): built by maturin into a virtual
# environment made here, then its tests (multi-process jobs over TCP, mpi4py under mpirun).
echo "== Python package: fmt, clippy, pip install ./python into target/pyvenv, pytest"
cargo fmt --manifest-path python/Cargo.toml -- --check
CARGO_TARGET_DIR="$PWD/target/python" cargo clippy --manifest-path python/Cargo.toml --all-targets -- -D warnings
[ -x target/pyvenv/bin/python ] || python3 -m venv target/pyvenv
# torch (PyPI's, with its CUDA libraries: about 2 minutes and 5 GiB here) for the DDP hook tests;
# scikit-learn (its digits data set) and matplotlib for examples/python/train_under_attack.py;
# torchft (its lighthouse and Manager, pinned) for examples/python/torchft_train.py.
target/pyvenv/bin/pip install -q --no-cache-dir --disable-pip-version-check maturin numpy pytest mpi4py torch \
    scikit-learn matplotlib torchft==0.2.0
CARGO_TARGET_DIR="$PWD/target/python" target/pyvenv/bin/pip install -q --no-cache-dir --disable-pip-version-check ./python
BYZCOLL_BIN="$PWD/target/debug/byzcoll" target/pyvenv/bin/python -m pytest python/tests -q -rs -p no:cacheprovider 2>&1 |
    tee -a "$log"
# Each fuzz target for a few seconds (a SKIPPED line where nightly or cargo-fuzz is missing;
# cargo-fuzz comes from crates.io where a nightly toolchain is installed).
echo "== fuzz smoke (scripts/fuzz-smoke.sh)"
if rustup toolchain list 2>/dev/null | grep -q '^nightly' && ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    cargo install -q cargo-fuzz --locked
fi
FUZZ_SECONDS=5 scripts/fuzz-smoke.sh
echo "== disk: target/ holds $(du -sh target | cut -f1), $(df -h --output=avail . | tail -n 1 | tr -d ' ') left free"
# One closing line for the whole run (cargo prints one per test binary, the last often a doc-test
# crate with nothing in it).
# Skipped: ignored tests, and tests that found no GPU and said so with a SKIPPED line.
awk '/^test result:/ { p += $4; f += $6; i += $8 }
     !/^test result:/ && /[0-9]+ (passed|failed)/ && / in [0-9.]+s/ {
         for (k = 1; k < NF; k++) { if ($(k+1) ~ /^passed/) p += $k; if ($(k+1) ~ /^failed/) f += $k } }
     /SKIPPED:/ { s += gsub(/SKIPPED:/, "&") }
     END { printf "total: %d passed (%d of them skipped for want of a GPU), %d failed, %d ignored\n", p, s, f, i }' "$log"
