#!/usr/bin/env bash
# Builds the C interface and installs it under a prefix:
#   scripts/install-capi.sh /opt/byzcoll [cargo features, e.g. ucx,libfabric]
# puts include/byzcoll.h, lib/libbyzcoll.{so,a} and lib/pkgconfig/byzcoll.pc there. Then:
#   cc prog.c $(PKG_CONFIG_PATH=/opt/byzcoll/lib/pkgconfig pkg-config --cflags --libs byzcoll)
#   cc -static-libgcc prog.c $(pkg-config --cflags byzcoll) /opt/byzcoll/lib/libbyzcoll.a $(pkg-config --libs-only-l --static byzcoll | sed 's/-lbyzcoll//')
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${1:?usage: scripts/install-capi.sh PREFIX [FEATURES]}
features=${2:-}
cargo build --release -p byzcoll-capi ${features:+--features "$features"}
private=""
for f in ${features//,/ }; do
    case $f in
        ucx) private="$private $(pkg-config --libs ucx)" ;;
        libfabric) private="$private $(pkg-config --libs libfabric)" ;;
    esac
done
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
install -d "$prefix/include" "$prefix/lib/pkgconfig"
install -m 644 capi/include/byzcoll.h "$prefix/include/"
install -m 755 target/release/libbyzcoll.so "$prefix/lib/"
install -m 644 target/release/libbyzcoll.a "$prefix/lib/"
sed -e "s|@PREFIX@|$prefix|" -e "s|@VERSION@|$version|" -e "s|@PRIVATE@|${private# }|" \
    capi/byzcoll.pc.in > "$prefix/lib/pkgconfig/byzcoll.pc"
echo "installed byzcoll $version under $prefix"
