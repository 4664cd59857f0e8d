#!/usr/bin/env bash
# Prints, one per line, the Debian packages the test suite needs that this machine lacks (or
# the file tree at ROOT, for tests: `scripts/deps.sh /tmp/fake-root`). Each check looks for the
# artefact the build or a test really uses, not for something that resembles it:
#   libclang.so that bindgen loads (libclang-cpp.so is another library), the UCX and libfabric
#   headers that pkg-config's includedir points to (a .pc file alone is not enough), mpi.h
#   where Open MPI's mpicc looks for it, and each command the tests run (readelf, objcopy and
#   strip: scripts/install-capi.sh and its test).
set -euo pipefail
root=${1:-}
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)

have_cmd() {
    if [ -z "$root" ]; then
        command -v "$1" >/dev/null 2>&1
    else
        [ -x "$root/usr/bin/$1" ]
    fi
}

# pkg-config module $1 whose header $2 exists under its includedir.
have_header() {
    local inc
    if [ -n "$root" ]; then
        inc=$(PKG_CONFIG_LIBDIR="$root/usr/lib/$multiarch/pkgconfig:$root/usr/lib/pkgconfig:$root/usr/share/pkgconfig" \
            pkg-config --variable=includedir "$1" 2>/dev/null) || return 1
    else
        inc=$(pkg-config --variable=includedir "$1" 2>/dev/null) || return 1
    fi
    [ -n "$inc" ] && [ -f "$root$inc/$2" ]
}

have_file() {
    compgen -G "$root$1" >/dev/null
}

have_cmd mpirun || echo openmpi-bin
have_file "/usr/lib/$multiarch/openmpi/include/mpi.h" && have_cmd mpicc || echo libopenmpi-dev
have_cmd pgrep || echo procps
have_cmd pkg-config || echo pkg-config
have_header ucx ucp/api/ucp.h || echo libucx-dev
have_cmd ucx_info || echo ucx-utils
have_header libfabric rdma/fabric.h || echo libfabric-dev
have_cmd fi_info || echo libfabric-bin
have_file '/usr/lib/llvm-*/lib/libclang.so' || echo libclang-dev
have_cmd c++ || echo g++
have_cmd readelf && have_cmd objcopy && have_cmd strip || echo binutils
