#!/usr/bin/env bash
# Run on the development machine (not the GPU one): builds what the GPU checks
# need into .devbuild/ (release, CUDA required) and copies the non-system
# shared libraries those programs need into .devlibs/, so that a device `run`
# can carry both (carry: [".devbuild", ".devlibs"]) and tools/gpu/check.sh
# runs them there without building.  Both folders are git-ignored.
#
# Usage: tools/gpu/build.sh [ninja targets...]   (default: the check programs)
# Env:   KILN_BUNDLE_LIBS  the bundle-libs script (default ../shared/device/bundle-libs)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
build=.devbuild
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(tests/cuda/test_cuda_ops)

if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" -Dcuda=enabled --buildtype=release >/dev/null
fi
ninja -C "$build" -j2 "${targets[@]}"

bundle=${KILN_BUNDLE_LIBS:-$root/../shared/device/bundle-libs}
rm -rf .devlibs
mkdir -p .devlibs
bins=()
for t in "${targets[@]}"; do bins+=("$build/$t"); done
"$bundle" .devlibs "${bins[@]}" >/dev/null
echo "built ${targets[*]} into $build; $(ls .devlibs | wc -l) bundled libraries in .devlibs" \
     "($(du -sh "$build" .devlibs | awk '{print $1}' | paste -sd+) to carry)"
