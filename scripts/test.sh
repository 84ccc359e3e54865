#!/usr/bin/env bash
# Builds kiln with AddressSanitizer + UndefinedBehaviorSanitizer and runs the
# whole test suite; ends with one line "N passed, N failed".
# Usage: scripts/test.sh [meson test args...]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${KILN_TEST_BUILD:-build-test}
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled \
    --buildtype=debugoptimized >/dev/null || { echo "0 passed, 1 failed"; exit 1; }
fi
if ! ninja -C "$build" -j"$(nproc)"; then
  echo "build failed"
  echo "0 passed, 1 failed"
  exit 1
fi
meson test -C "$build" --print-errorlogs --num-processes "$(nproc)" "$@"
status=$?
log="$build/meson-logs/testlog.json"
passed=0; failed=0
if [ -f "$log" ]; then
  passed=$(grep -c '"result": "OK"' "$log" || true)
  failed=$(grep -cE '"result": "(FAIL|TIMEOUT|ERROR|UNEXPECTEDPASS)"' "$log" || true)
fi
echo "$passed passed, $failed failed"
[ "$status" -eq 0 ] && [ "$failed" -eq 0 ]
