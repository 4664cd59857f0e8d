#!/usr/bin/env bash
# byzcoll's GPU checks, for a machine with an NVIDIA GPU (see ../shared/GPU.md for the lent H200).
#
#   scripts/gpu-check.sh build   # here, no GPU needed: builds the GPU test and bench binaries
#                                # (release, --features cuda,nccl) into .gpu/
#   scripts/gpu-check.sh run     # on the GPU machine, no cargo needed: runs them; full logs go
#                                # to $OUT (or .gpu/out), a summary table is printed last
#
# Or both at once on a GPU machine that has cargo: `scripts/gpu-check.sh build run`.
set -euo pipefail
cd "$(dirname "$0")/.."

build() {
    mkdir -p .gpu
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
    rm -rf .gpu/*.bin .gpu/out .gpu/wheel
    # Test binaries of the GPU crates, named after their test target.
    cargo test --release -p byzcoll-cuda -p byzcoll-transport-nccl --features byzcoll-cuda/nccl,byzcoll-transport-nccl/nccl \
        --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = m["target"]["name"] + "-" + m["package_id"].split("#")[0].rsplit("/", 1)[-1]
        shutil.copy(m["executable"], ".gpu/test-" + name + ".bin")
'
    cargo bench -p byzcoll-cuda --bench kernels --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "kernels":
        shutil.copy(m["executable"], ".gpu/bench-kernels.bin")
'
    cargo build --release --features cuda,nccl --example gpu_allreduce --bin byzcoll
    cp target/release/examples/gpu_allreduce .gpu/example-gpu.bin
    cp target/release/byzcoll .gpu/byzcoll.bin
    # The Python package as a wheel (abi3: the GPU machine's python3 with its PyTorch takes
    # it), for CUDA tensors staged through pinned host memory; maturin from the test venv.
    local maturin=${MATURIN:-target/pyvenv/bin/maturin}
    if [ -x "$maturin" ]; then
        CARGO_TARGET_DIR="$PWD/target/python" "$maturin" build --release -q -m python/Cargo.toml \
            --compatibility linux --strip -o .gpu/wheel
    else
        echo "no maturin at $maturin (run scripts/test.sh once, or set MATURIN): no Python wheel"
    fi
    # Debug info would make them ~160 MB; the device run carries at most 64 MiB.
    for f in .gpu/*.bin; do strip --strip-debug "$f"; done
    sources >.gpu/SOURCES
    ls -la .gpu/
}

# A hash of the sources the binaries are built from, so a run refuses stale binaries.
sources() {
    find Cargo.toml Cargo.lock gpu transports runtime proto aggregators src examples benches python \
        -type f \( -name '*.rs' -o -name '*.cu' -o -name '*.h' -o -name '*.c' -o -name '*.cpp' \
        -o -name Cargo.toml -o -name Cargo.lock -o -name '*.py' \) -not -path '*/target/*' |
        LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1
}

run() {
    local out=${OUT:-.gpu/out}
    mkdir -p "$out"
    for lib in /usr/local/cuda/lib64 /usr/local/cuda-13.0/targets/x86_64-linux/lib; do
        [ -d "$lib" ] && export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    done
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1 || true
    if [ ! -f .gpu/SOURCES ] || [ "$(sources)" != "$(cat .gpu/SOURCES)" ]; then
        echo "FAIL: .gpu/ is missing or was built from other sources: run 'scripts/gpu-check.sh build' and carry .gpu"
        return 1
    fi
    # On the GPU machine a test that finds no GPU, NVRTC or NCCL is a failure, not a skip.
    local status=0
    # The tests that need the GPU (the NVRTC and emulated-kernel tests run in CI already).
    for name in test-device-gpu test-device_exchange-gpu test-gpu-nccl test-byzcoll_cuda-gpu \
        test-byzcoll_transport_nccl-nccl; do
        local t=.gpu/$name.bin
        if [ ! -x "$t" ]; then
            echo "FAIL $name: no binary"
            status=1
        # (without_nccl_* is the no-GPU test: it reports itself skipped where NCCL runs.)
        elif timeout 150 "$t" --test-threads=1 --skip without_nccl_ >"$out/$name.log" 2>&1; then
            local passed skipped
            passed=$(awk '/^test result:/ { p += $4 } END { print p + 0 }' "$out/$name.log")
            skipped=$(grep -c 'SKIPPED' "$out/$name.log" || true)
            if [ "$skipped" -gt 0 ]; then
                echo "FAIL $name: $skipped tests skipped on the GPU machine"
                grep 'SKIPPED' "$out/$name.log" | sort | uniq -c | head -5
                status=1
            else
                echo "PASS $name: $passed tests"
            fi
        else
            echo "FAIL $name (log: $out/$name.log)"
            tail -30 "$out/$name.log"
            status=1
        fi
    done
    # The example: device vectors over real NCCL at world size 1 (one GPU), f32 and bf16; then
    # 5 processes sharing the GPU over TCP (robust_all_reduce_device; Krum needs n > 2f + 2).
    example() {
        local log=$1
        shift
        if timeout 150 "$@" >"$out/$log.log" 2>&1; then
            echo "PASS example $log"
        else
            echo "FAIL example $log (log: $out/$log.log)"
            status=1
        fi
        tail -12 "$out/$log.log"
    }
    example gpu-nccl-f32 env BYZCOLL_TRANSPORT=nccl BYZCOLL_RANK=0 BYZCOLL_WORLD_SIZE=1 \
        .gpu/example-gpu.bin --d 33554432 --byzantine 0
    example gpu-nccl-bf16 env BYZCOLL_TRANSPORT=nccl BYZCOLL_RANK=0 BYZCOLL_WORLD_SIZE=1 \
        .gpu/example-gpu.bin --d 33554432 --byzantine 0 --bf16
    example gpu-tcp-5-processes .gpu/byzcoll.bin launch -n 5 -- .gpu/example-gpu.bin --d 4194304 \
        --byzantine 1
    # Python: CUDA tensors through every entry point (the staging test), then the training
    # example on CUDA models under 5 processes sharing the GPU over TCP, f32 and bf16, the
    # median against a sign-flipping rank (steps/s and accuracy in the logs).
    if ls .gpu/wheel/byzcoll-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/byzcoll-site .gpu/wheel/byzcoll-*.whl
        if PYTHONPATH=/tmp/byzcoll-site timeout 150 python3 -m pytest -q -rs -p no:cacheprovider \
            python/tests/test_torch.py -k "cuda or staged" >"$out/python-cuda.log" 2>&1 &&
            ! grep -q SKIPPED "$out/python-cuda.log"; then
            echo "PASS python-cuda: $(grep -E '[0-9]+ passed' "$out/python-cuda.log" | tail -1)"
        else
            echo "FAIL python-cuda (log: $out/python-cuda.log)"
            tail -30 "$out/python-cuda.log"
            status=1
        fi
        for dtype in float32 bfloat16; do
            example "train-cuda-$dtype" env PYTHONPATH=/tmp/byzcoll-site OMP_NUM_THREADS=1 \
                .gpu/byzcoll.bin launch -n 5 -- python3 examples/python/train_under_attack.py \
                --device cuda --dtype "$dtype" --rules median --attacks none,sign-flip --steps 100 \
                --out "$out/train-cuda-$dtype.json"
        done
    else
        echo "FAIL python: no wheel in .gpu/wheel (scripts/gpu-check.sh build needs maturin)"
        status=1
    fi
    if [ -x .gpu/bench-kernels.bin ]; then
        timeout 400 .gpu/bench-kernels.bin --n 8,16,32,64,128 --exp 25 \
            --rules median,trimmed-mean,krum \
            --torch-script benches/anchors/torch_aggregators.py --out "$out/kernels.md" \
            >"$out/bench.log" 2>&1 || status=1
        tail -40 "$out/bench.log"
        if grep -q 'SKIPPED' "$out/bench.log"; then
            echo "FAIL bench: it skipped on the GPU machine"
            status=1
        fi
    fi
    return $status
}

[ $# -gt 0 ] || { sed -n '2,10p' "$0"; exit 2; }
for step in "$@"; do
    case "$step" in
    build) build ;;
    run) run ;;
    *) echo "unknown step $step (build or run)" >&2; exit 2 ;;
    esac
done
