# Sourced by the tools/gpu scripts on the GPU machine:
#
#   . "$root/tools/gpu/common.sh"
#   kiln_gpu_libpath "$root/.devlibs"
#   sec_ops() { ...; }                      # one function per section
#   kiln_gpu_run sec "$@"; exit $?          # runs sec_<name> for each name
#
# kiln_gpu_libpath DIR puts DIR (the bundled libraries), the CUDA toolkit's
# library folders and the NVIDIA pip wheels next to PyTorch (cuBLASLt, and
# the cuDNN that kiln dlopens) in front of LD_LIBRARY_PATH, in that order.
kiln_gpu_libpath() {
  local path=$1 d
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib; do
    [ -d "$d" ] && path=$path:$d
  done
  while read -r d; do path=$path:$d; done < <(python3 - 2>/dev/null <<'PY' || true
import glob, os, site
for sp in site.getsitepackages():
    for lib in glob.glob(os.path.join(sp, "nvidia", "**", "lib"), recursive=True):
        print(lib)
PY
)
  export LD_LIBRARY_PATH=$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

# kiln_gpu_run PREFIX NAME...: runs PREFIX_NAME for each name in order,
# each under "=== NAME", then a summary line per name (ok or FAILED, and
# its seconds).  Returns 1 when any failed, 2 for an unknown name.
kiln_gpu_run() {
  local prefix=$1 s r t0 ms status=0
  shift
  local summary=()
  for s in "$@"; do
    if ! declare -F "${prefix}_$s" >/dev/null; then
      echo "unknown name '$s' (have: $(declare -F | sed -n "s/^declare -f ${prefix}_//p" | xargs))"
      return 2
    fi
    echo
    echo "=== $s"
    t0=$(date +%s%N)
    if "${prefix}_$s"; then r=ok; else r=FAILED; status=1; fi
    ms=$((($(date +%s%N) - t0) / 1000000))
    summary+=("$(printf '%-9s | %-6s | %5d.%d s' "$s" "$r" $((ms / 1000)) $((ms % 1000 / 100)))")
  done
  echo
  echo "=== summary"
  printf '%s\n' "${summary[@]}"
  return $status
}
