#!/usr/bin/env bash
# Run on the development machine (not the GPU one): builds what the GPU checks
# need into .devbuild/ (release, CUDA required), copies the non-system
# shared libraries those programs need into .devlibs/ and the klein and Z-Image oracle
# cases and checkpoints (about 30 MB, folder layout of ../shared kept so the
# checkpoints' link stubs resolve) into .devdata/, so that tools/gpu/check.sh
# and bench.sh run them there without building.  All are git-ignored.
# Together they are more than a device `run` carries (64 MiB):
# tools/gpu/pack.sh packs them into one file.
#
# Usage: tools/gpu/build.sh [--bench] [ninja targets...]
#   (default: the check programs; --bench adds the benchmark's)
# Env:   KILN_BUNDLE_LIBS  the bundle-libs script (default ../shared/device/bundle-libs)
#        KILN_SHARED       the shared data folder (default ../shared)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
build=.devbuild
bench=()
if [ "${1:-}" = --bench ]; then
  shift
  bench=(tools/bench/kiln-bench tools/bench/kiln-stagebench tools/bench/kiln-opbench
         tools/bench/kiln-fp8probe)
fi
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(tests/cuda/test_cuda_ops tests/cuda/test_cuda_pipeline
                                     tests/cuda/test_cuda_replay tests/cuda/test_cuda_mixed
                                     tests/cuda/test_cuda_vae_band
                                     tests/cuda/test_cuda_ipc tests/cuda/compare_outputs tools/kiln
                                     tools/bench/kiln-soak tools/bench/kiln-pngbench
                                     tools/bench/kiln-quality
                                     services/gateway/kiln-gateway services/kiln-encoder
                                     services/kiln-denoiser services/kiln-decoder
                                     services/kiln-stages)
targets+=("${bench[@]}")

if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" -Dcuda=enabled --buildtype=release >/dev/null
fi
# meson 1.0 (Debian 12) writes no dependency files for nvcc, so ninja does
# not rebuild a .cu object when a header it includes changes (a struct that
# grew a field then crashes at run time): rebuild them all when a header is
# newer than the oldest CUDA object.
cu_objs=$build/kernels/libkiln_kernels.a.p
oldest=$(ls -tr "$cu_objs"/*.cu.o 2>/dev/null | head -1 || true)
if [ -n "$oldest" ] && [ -n "$(find kernels common \( -name '*.h' -o -name '*.cuh' \) \
                                  -newer "$oldest" | head -1)" ]; then
  rm -f "$cu_objs"/*.cu.o
fi
ninja -C "$build" -j2 "${targets[@]}"

bundle=${KILN_BUNDLE_LIBS:-$root/../shared/device/bundle-libs}
rm -rf .devlibs
mkdir -p .devlibs
bins=()
for t in "${targets[@]}"; do bins+=("$build/$t"); done
"$bundle" .devlibs "${bins[@]}" >/dev/null
# The klein and Z-Image oracle without the debug tensors (the GPU test does
# not read them).
shared=${KILN_SHARED:-$root/../shared}
rm -rf .devdata
mkdir -p .devdata/oracle/ckpt .devdata/data/qwen3-tokenizer
cp -r "$shared"/oracle/ckpt/klein-tiny "$shared"/oracle/ckpt/klein-base-tiny \
  "$shared"/oracle/ckpt/zimage-tiny .devdata/oracle/ckpt/
cp "$shared"/data/qwen3-tokenizer/{vocab.json,merges.txt} .devdata/data/qwen3-tokenizer/
for c in "$shared"/oracle/cases/klein_* "$shared"/oracle/cases/zimage_*; do
  mkdir -p ".devdata/oracle/cases/${c##*/}"
  cp "$c"/meta.json "$c"/ref_*.safetensors "$c"/*.png ".devdata/oracle/cases/${c##*/}/"
done
chmod -R u+w .devdata

echo "built ${targets[*]} into $build; $(ls .devlibs | wc -l) bundled libraries in .devlibs" \
     "($(du -sh "$build" .devlibs .devdata | awk '{print $1}' | paste -sd+) to carry)"
