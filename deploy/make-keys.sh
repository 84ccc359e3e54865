#!/usr/bin/env bash
# Makes the bus keys of a kiln deployment in DIR (default deploy/keys):
# gateway.key/.pub, replica.key/.pub (shared by the stage containers of
# compose.yaml) and replicas.allow (the gateway's allow-list).  Uses the
# `kiln` binary from KILN (default: `kiln` on PATH, else the build tree).
# The secret keys are mode 0600 and owned by uid 10001, the images' user.
set -euo pipefail
dir=${1:-$(dirname "$0")/keys}
kiln=${KILN:-$(command -v kiln || echo "$(dirname "$0")/../build/tools/kiln")}
mkdir -p "$dir"
for name in gateway replica; do
  [ -e "$dir/$name.key" ] || "$kiln" keygen --out "$dir/$name" >/dev/null
done
cat "$dir/replica.pub" > "$dir/replicas.allow"
if [ "$(id -u)" -eq 0 ]; then chown 10001:10001 "$dir"/*.key; fi
echo "bus keys in $dir"
