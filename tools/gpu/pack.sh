#!/usr/bin/env bash
# Packs what tools/gpu/check.sh and bench.sh need on the GPU machine into
# one file under the git-ignored tmp/, since the device tool carries at
# most 64 MiB and .devbuild (object files included), .devlibs and .devdata
# are more than that as they are.  Run here after tools/gpu/build.sh (with
# the bench executables as extra targets when benchmarking); there, unpack
# first:
#
#   tools/gpu/build.sh; tools/gpu/build.sh tools/bench/kiln-bench tools/bench/kiln-stagebench
#   tools/gpu/pack.sh                        # here: tmp/devpack.tar.xz, its size printed
#   tar -xJf tmp/devpack.tar.xz && tools/gpu/check.sh ...   # there (carry: tmp)
#
# It takes every executable .devbuild holds outside the object folders
# (stripped of symbols), the build's meson-info (for ninja -C), .devlibs and
# .devdata.  Fails when the result is over 60 MiB (room for the rest of
# the working tree).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
for d in .devbuild .devlibs .devdata; do
  [ -d "$d" ] || { echo "no $d: run tools/gpu/build.sh first" >&2; exit 1; }
done
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p tmp "$stage/.devbuild"
while read -r f; do
  mkdir -p "$stage/$(dirname "$f")"
  strip --strip-unneeded -o "$stage/$f" "$f" 2>/dev/null || cp "$f" "$stage/$f"
done < <(find .devbuild -type f -perm -u+x ! -path '*.p/*' ! -path '*/meson-*' ! -name '*.so*' \
           ! -name '*.sh' ! -name '*.py')
cp -r .devlibs .devdata "$stage/"
out=tmp/devpack.tar.xz
tar -C "$stage" -cJf "$out" .devbuild .devlibs .devdata
size=$(stat -c %s "$out")
echo "$out: $((size >> 20)) MiB ($(find "$stage/.devbuild" -type f | wc -l) executables," \
     "$(ls .devlibs | wc -l) libraries, the oracle data)"
[ "$size" -le $((60 << 20)) ] || { echo "over 60 MiB: carry less" >&2; exit 1; }
