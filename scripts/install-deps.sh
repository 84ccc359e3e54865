#!/usr/bin/env bash
# Installs the Debian packages kiln needs to build, test and run.
# Usage: scripts/install-deps.sh [--test]   (as root, or with sudo available)
# --test adds what only some tests need: Chromium for the playground test
# (tests/docs/check_playground.py, skipped without it) and promtool for
# test_serve_ux's `promtool check metrics`; CI passes it.
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
need_promtool=0
if [ "${1:-}" = "--test" ] && ! command -v promtool >/dev/null; then
  need_promtool=1
fi
if [ ${#missing[@]} -eq 0 ] && [ $need_promtool -eq 0 ]; then
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
if [ ${#missing[@]} -gt 0 ]; then
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if [ $need_promtool -eq 1 ]; then
  # Debian ships promtool in the prometheus package, whose installation
  # also enables and starts a Prometheus server (its postinst runs
  # invoke-rc.d start): only the one static binary is taken out of the
  # package, into /usr/local/bin.
  tmp=$(mktemp -d)
  chmod 777 "$tmp" # apt's _apt user downloads into it
  (cd "$tmp" && apt-get download -qq prometheus)
  dpkg-deb --fsys-tarfile "$tmp"/prometheus_*.deb | tar -x -C "$tmp" ./usr/bin/promtool
  $sudo install -m 0755 "$tmp/usr/bin/promtool" /usr/local/bin/promtool
  rm -rf "$tmp"
fi
