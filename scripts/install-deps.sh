#!/usr/bin/env bash
# Installs the Debian packages kiln needs to build, test and run.
# Usage: scripts/install-deps.sh [--test]   (as root, or with sudo available)
# --test adds what only some tests need: Chromium for the playground test
# (tests/docs/check_playground.py, skipped without it); CI passes it.
set -euo pipefail
packages=(
  build-essential meson ninja-build pkg-config
  libcjson-dev libpng-dev libturbojpeg0-dev libwebp-dev
  libpcre2-dev libutf8proc-dev
  libzmq3-dev libmsgpack-dev libuv1-dev libhttp-parser-dev
  clang libclang-rt-14-dev curl jq
)
if [ "${1:-}" = "--test" ]; then
  packages+=(chromium)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
