#!/usr/bin/env bash
# GPU checks, run ON the GPU machine from the repository root:
#
#   tools/gpu/check.sh [section...]      default: every section, in order
#
# Sections (each prints "=== name", its own output, and lands in the summary):
#   env    the GPU, driver and CUDA libraries this run uses
#   build  uses the build carried in .devbuild/ (tools/gpu/build.sh made it on
#          the dev machine, libraries in .devlibs/), else builds there with
#          meson/ninja/nvcc
#   ops    tests/cuda/test_cuda_ops: every backend op against the CPU reference
# Not run by default (slow; name them):
#   memcheck   test_cuda_ops under compute-sanitizer memcheck (out-of-bounds)
#   racecheck  test_cuda_ops under compute-sanitizer racecheck (shared memory)
# Add a section by writing a function sec_<name> and listing it in SECTIONS
# (or only in OPTIONAL when it should run on request).
#
# Full logs go to $OUT (the device tool's return folder) when set, else to
# .devbuild/logs.  Exit status: non-zero when any section failed.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
build=.devbuild
logs=${OUT:-$root/$build/logs}
mkdir -p "$logs"
SECTIONS=(env build ops)
OPTIONAL=(memcheck racecheck)

# CUDA libraries: the toolkit's folders, then the pip wheels next to PyTorch.
cuda_lib_dirs() {
  local d
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib; do
    [ -d "$d" ] && echo "$d"
  done
  python3 - 2>/dev/null <<'PY' || true
import glob, os, site
for sp in site.getsitepackages():
    for lib in glob.glob(os.path.join(sp, "nvidia", "**", "lib"), recursive=True):
        print(lib)
PY
}
libpath=$root/.devlibs
while read -r d; do libpath=$libpath:$d; done < <(cuda_lib_dirs)
export LD_LIBRARY_PATH=$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KILN_REQUIRE_GPU=1

sec_env() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || return 1
  command -v nvcc >/dev/null && nvcc --version | tail -2
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
}

sec_build() {
  local bin=$build/tests/cuda/test_cuda_ops
  if [ -x "$bin" ] && ! ldd "$bin" | grep -q "not found"; then
    echo "using the carried build in $build"
    return 0
  fi
  [ -x "$bin" ] && { echo "carried build misses libraries:"; ldd "$bin" | grep "not found"; }
  echo "building in $build (needs meson, ninja, nvcc and kiln's library headers)"
  export PATH=$PATH:/usr/local/cuda/bin
  if [ ! -f "$build/build.ninja" ]; then
    meson setup "$build" -Dcuda=enabled --buildtype=release || return 1
  fi
  ninja -C "$build" tests/cuda/test_cuda_ops
}

sec_ops() {
  "$build/tests/cuda/test_cuda_ops" 2>&1 | tee "$logs/ops.log"
}

# The op test under a compute-sanitizer tool; prints the sanitizer's summary.
sanitize() {
  local cs
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  [ -x "$cs" ] || { echo "compute-sanitizer not found"; return 1; }
  # The op test provokes one failing cudaMalloc on purpose; that API error is
  # expected, so API errors are not reported.
  timeout "${KILN_SANITIZE_TIMEOUT:-600}" \
    "$cs" --tool "$1" --report-api-errors no --error-exitcode 3 \
    "$build/tests/cuda/test_cuda_ops" >"$logs/$1.log" 2>&1
  local rc=$?
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases, .* failed" "$logs/$1.log"
  [ $rc -eq 0 ] || grep -m 20 -E "^=========  |Invalid|Race" "$logs/$1.log"
  return $rc
}
sec_memcheck() { sanitize memcheck; }
sec_racecheck() { sanitize racecheck; }

want=("$@")
[ ${#want[@]} -gt 0 ] || want=("${SECTIONS[@]}")
summary=()
status=0
for s in "${want[@]}"; do
  if ! declare -F "sec_$s" >/dev/null; then
    echo "unknown section '$s' (have: ${SECTIONS[*]} ${OPTIONAL[*]})"
    exit 2
  fi
  echo
  echo "=== $s"
  t0=$(date +%s%N)
  if "sec_$s"; then r=ok; else r=FAILED; status=1; fi
  ms=$((($(date +%s%N) - t0) / 1000000))
  summary+=("$(printf '%-8s | %-6s | %5d.%d s' "$s" "$r" $((ms / 1000)) $((ms % 1000 / 100)))")
done
echo
echo "=== summary"
printf '%s\n' "${summary[@]}"
exit $status
