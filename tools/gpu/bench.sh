#!/usr/bin/env bash
# The speed benchmark of docs/PERFORMANCE.md, run ON the GPU machine from the
# repository root, all steps in one run (same machine, same clocks):
#
#   tools/gpu/bench.sh [step...]   default: env ops parity opbench ckpt stages serve diffusers
#
# Steps (each prints "=== name", its output, and lands in the summary):
#   env        GPU, driver, the cuDNN kiln will dlopen, torch
#   ops        tests/cuda/test_cuda_ops (every CUDA op against the CPU
#              reference): the speed work must keep it passing
#   parity     tests/cuda/test_cuda_pipeline: the klein and Z-Image oracle cases on the
#              GPU (oracle from .devdata/ when carried, else ../shared)
#   opbench    kiln-opbench: attention at the pipeline's shapes (cuDNN and
#              the in-house kernel), one GEMM for calibration
#   ckpt       kiln make-checkpoint --preset M for each model M: full-size
#              random weights, bf16, streamed to disk (kept between steps)
#   stages     kiln-stagebench: encode / denoise (and one step) / decode / PNG
#              in one process, steady state; peak GPU memory
#   serve      kiln serve --device cuda, then kiln-bench through HTTP
#              (latency, and throughput unless KILN_BENCH_MODE=latency);
#              peak GPU memory of the whole service and of each process
#   mps        the serve step again with the CUDA MPS control daemon running
#              (issue 17: do the three stage processes stop time-slicing the
#              GPU?); results as kiln-bench-<model>-mps.json; the daemon is
#              stopped afterwards.  Not in the default steps.
#   colocate   the serve step again with kiln serve --colocate: the three
#              stages as threads of one kiln-stages process, one CUDA
#              context (issue 17's other answer to time-slicing); results
#              as kiln-bench-<model>-colocate.json.  Not in the default steps.
#   diffusers  diffusers' Flux2KleinPipeline (ZImagePipeline for Z-Image) on the same checkpoint folder,
#              bf16, B=1 latency the same way (tools/bench/diffusers_bench.py);
#              the diffusers wheel comes from .whl/ (carry it: see below)
#
# Binaries come from $KILN_BUILD (default .devbuild: tools/gpu/build.sh
# tools/kiln tools/bench/kiln-bench tools/bench/kiln-opbench
# tools/bench/kiln-stagebench tests/cuda/test_cuda_ops
# tests/cuda/test_cuda_pipeline and the service
# executables), their libraries from $KILN_LIBS (default .devlibs).  The
# diffusers wheel: `pip download --no-deps diffusers==0.42.1 -d .whl` here,
# carried with the run (torch and transformers are on the GPU machine).
#
# Env: KILN_BENCH_MODELS ("klein-4b"; e.g. "klein-4b klein-9b zimage-turbo":
#      each a kiln make-checkpoint preset, or a folder under KILN_BENCH_DATA
#      holding a model_index.json, kept as it is: a published checkpoint),
#      KILN_BENCH_DATA (/tmp/kiln-bench: checkpoints), KILN_BENCH_SIZE
#      (1024x1024), KILN_BENCH_STEPS (4 for klein), KILN_BENCH_ZIMAGE_STEPS
#      (9, Z-Image-Turbo's recipe), KILN_BENCH_N (20), KILN_BENCH_WARMUP
#      (3), KILN_BENCH_MODE (both|latency|throughput), KILN_BENCH_CONC
#      (4,8,16), KILN_BENCH_IMAGES (32), KILN_BENCH_REPEATS (3),
#      KILN_BENCH_ITERS (5: kiln-stagebench), KILN_BENCH_DIFFUSERS_N (= N),
#      KILN_BENCH_PORT (18500), KILN_BENCH_WHEELS (.whl: the wheels folder),
#      KILN_BENCH_TIMEOUT (1800: seconds for each long command of a step;
#      a timed-out kiln-bench still lets the step stop kiln serve),
#      KILN_BENCH_PRECISION ("exact"; "exact fp8" runs the stages, serve and
#      mps steps once per precision, fp8 being the opt-in FP8 mode of
#      docs/PERFORMANCE.md, kiln serve --precision fp8; its results are
#      labelled <model>-fp8, e.g. kiln-bench-klein-4b-fp8.json).
# Results go to $OUT (the device tool's return folder) when set, else to
# $KILN_BUILD/bench: kiln-bench-<model>.json, diffusers-<model>.json and the
# logs; at most a few files, since a device run returns at most 8.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
build=${KILN_BUILD:-.devbuild}
libs=${KILN_LIBS:-.devlibs}
out=${OUT:-$root/$build/bench}
mkdir -p "$out"
models=(${KILN_BENCH_MODELS:-klein-4b})
data=${KILN_BENCH_DATA:-/tmp/kiln-bench}
size=${KILN_BENCH_SIZE:-1024x1024}
steps=${KILN_BENCH_STEPS:-4}
n=${KILN_BENCH_N:-20}
warmup=${KILN_BENCH_WARMUP:-3}
port=${KILN_BENCH_PORT:-18500}
limit=${KILN_BENCH_TIMEOUT:-1800}
serve_tag= # names the serve step's results (step_mps: -mps)
serve_args=() # more kiln serve options (step_colocate: --colocate)
precisions=(${KILN_BENCH_PRECISION:-exact})
# The tag of precision $1 in result names: none for exact, -fp8 for fp8.
ptag() { if [ "$1" = exact ]; then echo ""; else echo "-$1"; fi; }
STEPS=(env ops parity opbench ckpt stages serve diffusers)
log=$out/steps.log # the long outputs; stdout keeps the summaries
mem=$(mktemp -d)    # memory samples (not returned: a device run returns 8 files)
trap 'rm -rf "$mem"' EXIT

. "$root/tools/gpu/common.sh"
kiln_gpu_libpath "$root/$libs"

# Samples the GPU's used memory every 100 ms into $1 until killed.
mem_sampler() {
  while :; do
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1
    sleep 0.1
  done >"$1"
}
# Samples each CUDA process's memory every 100 ms into $1 until killed
# ("pid, name, MiB" lines).
apps_sampler() {
  while :; do
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits \
      2>/dev/null
    sleep 0.1
  done >"$1"
}
# Each process's peak in the samples file $1, by executable name.
apps_peak() {
  awk -F', *' 'NF >= 3 && $3 + 0 > 0 { n = $2; sub(/.*\//, "", n); if ($3 + 0 > m[n]) m[n] = $3 + 0 }
    END { for (n in m) printf "    %-16s %6.2f GiB\n", n, m[n] / 1024 }' "$1" | sort
}
# Peak used memory in the samples file $1 minus the idle reading $2, in GiB.
mem_peak() {
  sort -n "$1" | tail -1 | awk -v idle="$2" '{printf "%.2f GiB (peak %d MiB used, %d idle)", ($1 - idle) / 1024, $1, idle}'
}
mem_idle() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }

# The steps a model is benchmarked with: its published recipe, by the
# folder's pipeline class (so a published folder named anything, e.g.
# KILN_BENCH_DATA=/models KILN_BENCH_MODELS=Z-Image-Turbo, gets Turbo's 9).
steps_of() {
  if grep -q '"ZImagePipeline"' "$data/$1/model_index.json" 2>/dev/null; then
    echo "${KILN_BENCH_ZIMAGE_STEPS:-9}"
  else
    echo "$steps"
  fi
}

step_env() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 - <<'PY'
import ctypes, torch
try:
    lib = ctypes.CDLL("libcudnn.so.9")
    lib.cudnnGetVersion.restype = ctypes.c_size_t
    print("cuDNN (dlopen libcudnn.so.9):", lib.cudnnGetVersion())
except OSError as e:
    print("cuDNN: not loadable:", e)
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
PY
}

step_ops() {
  timeout "$limit" "$build/tests/cuda/test_cuda_ops" >"$out/ops.log" 2>&1
  local rc=$?
  grep -E "cuDNN|cudnn|attention|cases, " "$out/ops.log"
  return $rc
}

step_parity() {
  # Absolute: the KV case links the checkpoint's folders from /tmp.
  local shared=$root/../shared
  [ -d .devdata/oracle ] && shared=$root/.devdata
  KILN_SHARED=$shared timeout "$limit" "$build/tests/cuda/test_cuda_pipeline" >"$out/parity.log" 2>&1
  local rc=$?
  grep -E "checks, .* failed|CHECK failed|cuDNN" "$out/parity.log"
  if [ $rc -ne 0 ]; then
    # Tells a cuDNN regression from a failure of the pipeline itself.
    echo "again with KILN_CUDNN=0 (kiln's kernels only):"
    KILN_CUDNN=0 KILN_SHARED=$shared timeout "$limit" "$build/tests/cuda/test_cuda_pipeline" 2>&1 |
      grep -E "checks, .* failed|CHECK failed" | head -20
  fi
  return $rc
}

step_opbench() {
  "$build/tools/bench/kiln-opbench" 2>&1
}

step_ckpt() {
  local m
  for m in "${models[@]}"; do
    if [ -f "$data/$m/model_index.json" ]; then
      echo "$m: kept $data/$m"
      continue
    fi
    local t0=$(date +%s)
    rm -rf "${data:?}/$m"
    timeout "$limit" "$build/tools/kiln" make-checkpoint --preset "$m" --out "$data/$m" \
      --tokenizer data/qwen3-tokenizer >>"$log" 2>&1 || return 1
    echo "$m: $(du -sh "$data/$m" | cut -f1) in $(($(date +%s) - t0)) s"
  done
}

step_stages() {
  local m p idle rc=0
  for m in "${models[@]}"; do
  for p in "${precisions[@]}"; do
    idle=$(mem_idle)
    mem_sampler "$mem/stages.txt" &
    local sampler=$!
    timeout "$limit" "$build/tools/bench/kiln-stagebench" --model "$data/$m" --device cuda \
      --size "$size" --steps "$(steps_of "$m")" --iters "${KILN_BENCH_ITERS:-5}" --warmup 1 \
      --precision "$p" --prompts tools/bench/prompts.txt 2>>"$log" || rc=1
    kill "$sampler"
    wait "$sampler" 2>/dev/null
    echo "  peak GPU memory $(mem_peak "$mem/stages.txt" "$idle")"
  done
  done
  return $rc
}

step_serve() {
  local m p l idle rc=0 mode=${KILN_BENCH_MODE:-both}
  for m in "${models[@]}"; do
  for p in "${precisions[@]}"; do
    l=$m$(ptag "$p")$serve_tag
    idle=$(mem_idle)
    "$build/tools/kiln" serve --model "$data/$m" --device cuda --port "$port" --precision "$p" \
      "${serve_args[@]}" >"$out/serve-$l.log" 2>&1 &
    local pid=$!
    mem_sampler "$mem/serve.txt" &
    local sampler=$!
    apps_sampler "$mem/apps.txt" &
    local apps=$!
    timeout "$limit" "$build/tools/bench/kiln-bench" --url "http://127.0.0.1:$port" --wait-ready 300 \
      --prompts tools/bench/prompts.txt \
      --mode "$mode" --size "$size" --steps "$(steps_of "$m")" --requests "$n" --warmup "$warmup" \
      --concurrency "${KILN_BENCH_CONC:-4,8,16}" --images "${KILN_BENCH_IMAGES:-32}" \
      --repeats "${KILN_BENCH_REPEATS:-3}" --label "$l" --json "$out/kiln-bench-$l.json" || rc=1
    kill "$sampler" "$apps"
    wait "$sampler" "$apps" 2>/dev/null
    echo "  peak GPU memory of the service $(mem_peak "$mem/serve.txt" "$idle")"
    echo "  peak per process (nvidia-smi --query-compute-apps):"
    apps_peak "$mem/apps.txt"
    kill -TERM "$pid"
    wait "$pid"
    [ $rc -eq 0 ] || tail -20 "$out/serve-$l.log"
  done
  done
  return $rc
}

# MPS lets the kernels of the stage processes run side by side instead of
# taking turns on the GPU (docs.nvidia.com/deploy/mps).  The daemon's pipe
# and log folders are private to this run.
step_mps() {
  local ctl rc=0
  ctl=$(command -v nvidia-cuda-mps-control) || { echo "nvidia-cuda-mps-control not installed"; return 1; }
  export CUDA_MPS_PIPE_DIRECTORY=$mem/mps-pipe CUDA_MPS_LOG_DIRECTORY=$mem/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  "$ctl" -d || { echo "the MPS control daemon did not start"; return 1; }
  serve_tag=-mps step_serve || rc=1
  echo quit | "$ctl"
  grep -h -i -m 5 "error\|fail" "$CUDA_MPS_LOG_DIRECTORY"/*.log 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  return $rc
}

# The stages as threads of one process: one CUDA context, whose streams'
# kernels overlap (docs/ARCHITECTURE.md, "One process, several stages").
step_colocate() {
  local rc=0
  serve_args=(--colocate)
  serve_tag=-colocate step_serve || rc=1
  serve_args=()
  return $rc
}

step_diffusers() {
  local m rc=0
  local whl=${KILN_BENCH_WHEELS:-.whl}
  ls "$whl"/diffusers-*.whl >/dev/null 2>&1 || { echo "no $whl/diffusers-*.whl carried"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kiln-bench-site "$whl"/*.whl >>"$log" 2>&1 || return 1
  for m in "${models[@]}"; do
    PYTHONPATH=/tmp/kiln-bench-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 timeout "$limit" \
      python3 tools/bench/diffusers_bench.py --model "$data/$m" --size "$size" --steps "$(steps_of "$m")" \
      --n "${KILN_BENCH_DIFFUSERS_N:-$n}" --warmup "$warmup" --json "$out/diffusers-$m.json" \
      2>>"$log" || rc=1
  done
  return $rc
}

want=("$@")
[ ${#want[@]} -gt 0 ] || want=("${STEPS[@]}")
kiln_gpu_run step "${want[@]}"
exit $?
