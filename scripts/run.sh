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
  # The tiny checkpoint records the text-encoder layers it needs (1, 2, 3);
  # one made by an older kiln does not, and is made again.
  if ! grep -q text_encoder_out_layers "$ckpt/model_index.json" 2>/dev/null; then
    rm -rf "$ckpt"
    "$build/tools/kiln" make-checkpoint --preset tiny --out "$ckpt"
  fi
  args=(--model "$ckpt" --min-size 64 "${args[@]+"${args[@]}"}")
fi
exec "$build/tools/kiln" serve "${args[@]}"
