#!/usr/bin/env bash
# Builds the C interface and installs it under a prefix:
#   scripts/install-capi.sh /opt/byzcoll [cargo features, e.g. ucx,libfabric]
# puts there
#   include/byzcoll.h
#   lib/libbyzcoll.so.N.MINOR.PATCH, with the links libbyzcoll.so.N (its SONAME: N is the header's
#       BYZCOLL_ABI_VERSION) and libbyzcoll.so (what -lbyzcoll finds)
#   lib/libbyzcoll.a
#   lib/.debug/libbyzcoll.so.N.MINOR.PATCH.debug, the debug info taken out of the .so (gdb and
#       perf look there by themselves; nothing else needs it)
#   lib/pkgconfig/byzcoll.pc
# Both libraries are installed without debug info (strip --strip-debug). The .pc file's Libs
# carry -Wl,-rpath,PREFIX/lib, so a program linked with
#   cc prog.c $(PKG_CONFIG_PATH=/opt/byzcoll/lib/pkgconfig pkg-config --cflags --libs byzcoll)
# finds libbyzcoll.so.N when it runs, under mpirun too, with no LD_LIBRARY_PATH (README.md, "From
# C and C++", says how to do without the rpath). Statically:
#   cc -static-libgcc prog.c $(pkg-config --cflags byzcoll) /opt/byzcoll/lib/libbyzcoll.a $(pkg-config --libs-only-l --static byzcoll | sed 's/-lbyzcoll//')
# BYZCOLL_CAPI_LIB_DIR=DIR installs the libbyzcoll.so and libbyzcoll.a that a cargo build of this
# checkout left in DIR instead of running `cargo build --release` (the tests install their own
# build: capi/tests/c.rs).
set -euo pipefail
prefix=${1:?usage: scripts/install-capi.sh PREFIX [FEATURES]}
features=${2:-}
# An absolute prefix (a relative one is the caller's): the .pc file and the rpath name it.
install -d "$prefix/include" "$prefix/lib/pkgconfig" "$prefix/lib/.debug"
prefix=$(cd "$prefix" && pwd)
lib=$prefix/lib
lib_dir=""
[ -z "${BYZCOLL_CAPI_LIB_DIR:-}" ] || lib_dir=$(cd "$BYZCOLL_CAPI_LIB_DIR" && pwd)
cd "$(dirname "$0")/.."
if [ -z "$lib_dir" ]; then
    cargo build --release -p byzcoll-capi ${features:+--features "$features"}
    lib_dir=${CARGO_TARGET_DIR:-target}/release
fi
# The static library needs what the shared one links: the transports compiled in (by these
# features, or by any other crate's in the build that left the libraries in DIR).
needed=$(readelf -d "$lib_dir/libbyzcoll.so" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p')
private=""
case " $(echo $needed) " in *" libucp.so"*) private="$private $(pkg-config --libs ucx)" ;; esac
case " $(echo $needed) " in *" libfabric.so"*) private="$private $(pkg-config --libs libfabric)" ;; esac
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
# The SONAME capi/build.rs gave the library: libbyzcoll.so.N.
soname=$(readelf -d "$lib_dir/libbyzcoll.so" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
case $soname in
    libbyzcoll.so.[0-9]*) ;;
    *) echo "$lib_dir/libbyzcoll.so has no SONAME libbyzcoll.so.N (capi/build.rs sets it)" >&2; exit 1 ;;
esac
real=$soname.${version#*.}

install -m 644 capi/include/byzcoll.h "$prefix/include/"

install -m 755 "$lib_dir/libbyzcoll.so" "$lib/$real"
objcopy --only-keep-debug "$lib/$real" "$lib/.debug/$real.debug"
chmod 644 "$lib/.debug/$real.debug"
strip --strip-debug "$lib/$real"
objcopy --add-gnu-debuglink="$lib/.debug/$real.debug" "$lib/$real"
ln -sfn "$real" "$lib/$soname"
ln -sfn "$soname" "$lib/libbyzcoll.so"

install -m 644 "$lib_dir/libbyzcoll.a" "$lib/"
strip --strip-debug "$lib/libbyzcoll.a"

sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" -e "s|@PRIVATE@|${private# }|" \
    capi/byzcoll.pc.in > "$lib/pkgconfig/byzcoll.pc"
echo "installed byzcoll $version under $prefix: $real ($soname), libbyzcoll.a, byzcoll.h, byzcoll.pc"
