#!/usr/bin/env bash
# Kernel-time profile of one klein image, run ON the GPU machine from the
# repository root: `kiln generate --device cuda` under Nsight Compute (one
# duration metric per kernel, clocks not locked), then the kernels summed by
# name within each stage (text encoder, DiT, VAE decoder), largest first.
# The stages are told apart by the kernels that only they run.
#
#   tools/gpu/profile.sh MODEL_DIR [SIZE] [STEPS]     (1024x1024, 1 step)
#
# Binaries from $KILN_BUILD (.devbuild), libraries from $KILN_LIBS
# (.devlibs) and the CUDA/cuDNN folders as tools/gpu/bench.sh finds them.
# Writes $OUT/profile.csv (ncu's raw output) and prints the summary.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
model=${1:?usage: tools/gpu/profile.sh MODEL_DIR [SIZE] [STEPS]}
size=${2:-1024x1024}
steps=${3:-1}
build=${KILN_BUILD:-.devbuild}
out=${OUT:-$root/$build/profile}
mkdir -p "$out"
. "$root/tools/gpu/common.sh"
kiln_gpu_libpath "$root/${KILN_LIBS:-.devlibs}"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
[ -n "$ncu" ] || { echo "ncu not found"; exit 1; }

# Op by op (KILN_GRAPHS=0): ncu lists the kernels of a graph launch as well,
# but the eager order is the one the stages are recognised by.
KILN_GRAPHS=0 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
  "$build/tools/kiln" generate --model "$model" --prompt "a red fox in the snow" \
  --steps "$steps" --width "${size%x*}" --height "${size#*x}" --device cuda \
  --out "$out/profile.png" >"$out/profile.csv" 2>"$out/profile.err" || {
  tail -5 "$out/profile.err"; exit 1; }

python3 - "$out/profile.csv" <<'PY'
import csv, re, sys
from collections import defaultdict
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
name_i, unit_i, val_i = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
kernels = []
for r in rows:
    v = float(r[val_i].replace(",", ""))
    scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3, "second": 1e3}[r[unit_i]]
    kernels.append((r[name_i], v * scale))
# Stage boundaries: the DiT starts at its first qkv_split kernel (the encoder
# uses the unfused ops; the DiT's embedding GEMMs before it count with the
# encoder), the VAE decoder at its first group norm.
def first(pat):
    return next((i for i, (n, _) in enumerate(kernels) if re.search(pat, n)), len(kernels))
dit0, vae0 = first(r"qkv_split"), first(r"gn_|group_norm|conv")
stages = [("text encoder (+ DiT embeddings)", kernels[:dit0]), ("DiT", kernels[dit0:vae0]),
          ("VAE decoder", kernels[vae0:])]
for title, ks in stages:
    tot = sum(t for _, t in ks)
    print(f"== {title}: {len(ks)} kernels, {tot:.2f} ms")
    by = defaultdict(lambda: [0, 0.0])
    for n, t in ks:
        key = re.sub(r"<.*", "", n)[:70]
        by[key][0] += 1
        by[key][1] += t
    for key, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  {t:8.2f} ms {100 * t / max(tot, 1e-9):5.1f}%  x{c:<4d} {key}")
PY
