#!/usr/bin/env bash
# The soak of issue 11, run ON the GPU machine from the repository root:
# kiln serve on the full-size klein-4B random checkpoint, driven by
# kiln-soak (tools/bench/) with mixed traffic for N minutes, a denoiser
# SIGKILLed and one SIGSTOPped on the way, memory per process sampled.
#
#   tools/gpu/soak.sh [--minutes 6] [--first 2048x2048] [--concurrency 8]
#                     [--denoisers 2] [--stop-for 30] [--device cuda]
#                     [--model DIR] [--port 18600] [--serve-arg ARG]...
#                     [-- kiln-soak options...]
#
# With --serve-arg --colocate the stages run as kiln-stages processes and
# each fault takes one such process whole (its three stages).
# Without --model it makes (once per machine, ~15 GB, ~20 s) the random
# klein-4B checkpoint in $KILN_FULLSIZE_DIR (default /tmp/kiln-klein-4b,
# the one tools/gpu/check.sh fullsize uses).  --first WxH sends one
# generation of that size before the traffic (the issue's 2048x2048 first).
# The kill comes at a third of the run, the stop (--stop-for seconds) at
# two thirds; memory growth is judged after the first fifth.  kiln-soak's
# summary is printed; the results go to $OUT (the device tool's return
# folder) when set, else $KILN_BUILD/soak: summary.json, requests.csv,
# samples.csv, memory.png, soak.txt (the summary), soak.log (kiln-soak's
# log: the faults as they happened) and serve.log: 7 files, so that
# `check.sh devicefault` (which leaves one) may share $OUT in one device
# run, which returns at most 8.  Exit
# status: kiln-soak's (0: passed).  A device command runs at most 10
# minutes: keep --minutes at 6 or less there (checkpoint, model loads, the
# first request and the last answers take the rest).
#
# Binaries come from $KILN_BUILD (default .devbuild: tools/gpu/build.sh
# tools/kiln tools/bench/kiln-soak and the service executables), their
# libraries from $KILN_LIBS (default .devlibs).  The script's own check, on
# the CPU with the tiny checkpoint:
#   KILN_BUILD=build-test tools/gpu/soak.sh --device cpu --minutes 1.5 \
#     --model ../shared/oracle/ckpt/klein-tiny --stop-for 5 --concurrency 3 \
#     --serve-arg --min-size --serve-arg 64 --serve-arg --max-size --serve-arg 128 \
#     --serve-arg --text-encoder-out-layers --serve-arg 1,2,3 \
#     -- --min-side 64 --max-side 128 --steps 2 --max-sequence-length 32
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
build=${KILN_BUILD:-.devbuild}
libs=${KILN_LIBS:-.devlibs}
out=${OUT:-$root/$build/soak}
minutes=6 first= conc=8 denoisers=2 stop_for=30 device=cuda model= port=18600
serve_args=() soak_args=()
while [ $# -gt 0 ]; do
  case $1 in
    --minutes) minutes=$2; shift 2 ;;
    --first) first=$2; shift 2 ;;
    --concurrency) conc=$2; shift 2 ;;
    --denoisers) denoisers=$2; shift 2 ;;
    --stop-for) stop_for=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --serve-arg) serve_args+=("$2"); shift 2 ;;
    --) shift; soak_args=("$@"); break ;;
    *) echo "soak.sh: unknown option $1 (see the header of $0)"; exit 2 ;;
  esac
done
mkdir -p "$out"
: >"$out/soak.log"
. "$root/tools/gpu/common.sh"
kiln_gpu_libpath "$root/$libs"
kiln=$build/tools/kiln
for b in "$kiln" "$build/tools/bench/kiln-soak"; do
  [ -x "$b" ] || { echo "soak.sh: no $b (run tools/gpu/build.sh tools/kiln tools/bench/kiln-soak ...)"; exit 1; }
done

if [ -z "$model" ]; then
  model=${KILN_FULLSIZE_DIR:-/tmp/kiln-klein-4b}
  if [ ! -f "$model/model_index.json" ]; then
    rm -rf "$model"
    t0=$(date +%s)
    tok=()
    [ -d data/qwen3-tokenizer ] && tok=(--tokenizer data/qwen3-tokenizer)
    "$kiln" make-checkpoint --preset klein-4b --out "$model" "${tok[@]}" >>"$out/soak.log" 2>&1 ||
      { tail -5 "$out/soak.log"; exit 1; }
    echo "checkpoint $model: $(du -sh "$model" | cut -f1) in $(($(date +%s) - t0)) s"
  else
    echo "checkpoint $model: kept"
  fi
fi
[ "$device" = cuda ] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

"$kiln" serve --model "$model" --device "$device" --port "$port" --denoisers "$denoisers" \
  "${serve_args[@]}" >"$out/serve.log" 2>&1 &
serve=$!
trap 'kill -TERM $serve 2>/dev/null' EXIT
secs=$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 }')
firsts=()
[ -n "$first" ] && firsts=(--first "$first")
echo "kiln serve pid $serve ($device, $denoisers denoisers); $secs s of traffic at concurrency $conc" \
  "${first:+after one $first request}"
# kiln-soak waits for /readyz (model loads), then runs; its summary is
# printed and kept as soak.txt.
"$build/tools/bench/kiln-soak" --url "http://127.0.0.1:$port" --duration "$secs" \
  --concurrency "$conc" --serve-pid "$serve" --wait-ready 600 --sample 2 \
  --stop "denoise@$((secs * 2 / 3))+$stop_for" "${firsts[@]}" --out "$out" \
  --label "soak $device ${minutes} min${first:+, $first first}" "${soak_args[@]}" 2>>"$out/soak.log" |
  tee "$out/soak.txt"
rc=${PIPESTATUS[0]}
kill -TERM "$serve"
wait "$serve"
serve_rc=$?
trap - EXIT
echo "kiln serve exited with $serve_rc"
grep -E "illegal memory access|device lost|exited with status|was killed by signal|said bye" "$out/serve.log" |
  cut -c1-200 | tail -20
# The log of a long run can pass the 16 MB a device run returns per file.
if [ "$(stat -c %s "$out/serve.log")" -gt 8000000 ]; then
  { head -c 2000000 "$out/serve.log"; echo; echo "[... cut ...]"; tail -c 4000000 "$out/serve.log"; } \
    >"$out/serve.cut" && mv "$out/serve.cut" "$out/serve.log"
fi
grep -E "kiln-soak: (kill|stop|SIGCONT|first)" "$out/soak.log" | cut -c1-200
exit $rc
