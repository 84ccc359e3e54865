#!/usr/bin/env bash
# Installs the dependencies, builds kiln and runs the service.
# Without --model it serves a tiny random-weight checkpoint generated on the
# first run (CPU backend), so the whole pipeline works on any machine.
# Usage: scripts/run.sh [--model DIR] [--device cpu|cuda] [--port P] [kiln serve options...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/install-deps.sh
build=${KILN_BUILD:-build-release}
[ -f "$build/build.ninja" ] || meson setup "$build" --buildtype=release >/dev/null
ninja -C "$build"
args=("$@")
if ! printf '%s\n' "${args[@]+"${args[@]}"}" | grep -qx -- '--model'; then
  ckpt=${KILN_TINY_CKPT:-$root/.data/tiny}
  [ -f "$ckpt/model_index.json" ] || "$build/tools/kiln" make-checkpoint --preset tiny --out "$ckpt"
  # The tiny model has 4 text-encoder layers, so it stacks hidden states 1-3.
  args=(--model "$ckpt" --min-size 64 --text-encoder-out-layers 1,2,3 "${args[@]+"${args[@]}"}")
fi
exec "$build/tools/kiln" serve "${args[@]}"
