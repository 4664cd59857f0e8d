#!/usr/bin/env bash
# A short run of every cargo-fuzz target in fuzz/ (libFuzzer, nightly): 10 s each by default
# (FUZZ_SECONDS overrides). Without a nightly toolchain with cargo-fuzz it prints a SKIPPED
# line and exits 0. The regression inputs in fuzz/regressions/<target>/ are replayed first, and
# every run starts from the committed corpus in fuzz/seeds/<target>/.
# Corpora and crash artifacts go to fuzz/corpus/ and fuzz/artifacts/ (both git-ignored).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "=================================================================="
    echo "SKIPPED: fuzz smoke (no nightly/cargo-fuzz)"
    echo "  install: rustup toolchain install nightly && cargo install cargo-fuzz --locked"
    echo "=================================================================="
    exit 0
fi

seconds="${FUZZ_SECONDS:-10}"
targets=(handshake_respond handshake_initiate frame_header npy secret)
for t in "${targets[@]}"; do
    flags=(-max_total_time="$seconds")
    [ "$t" = npy ] && flags+=(-rss_limit_mb=512 -malloc_limit_mb=256)
    if [ -d "regressions/$t" ] && [ -n "$(ls -A "regressions/$t")" ]; then
        echo "== fuzz $t: replaying regressions/$t"
        # Files (not a directory) as arguments: libFuzzer runs each once and writes nothing.
        cargo +nightly fuzz run -O "$t" "regressions/$t"/* -- "${flags[@]}"
    fi
    echo "== fuzz $t: ${seconds} s, starting from seeds/$t"
    mkdir -p "corpus/$t"
    # New inputs go to the first directory (git-ignored); seeds/ is the committed corpus that
    # the 10-million-run campaigns found (minimised), replayed by every smoke.
    cargo +nightly fuzz run -O "$t" "corpus/$t" "seeds/$t" -- "${flags[@]}"
done
echo "== fuzz smoke: ${#targets[@]} targets, no crash"
