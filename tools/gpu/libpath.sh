# Sourced by the tools/gpu scripts on the GPU machine:
#
#   . "$root/tools/gpu/libpath.sh" "$root/.devlibs"
#
# Puts the bundled libraries (the folder given), the CUDA toolkit's library
# folders and the NVIDIA pip wheels next to PyTorch (cuBLASLt, and the cuDNN
# that kiln dlopens) in front of LD_LIBRARY_PATH, in that order.
kiln_libpath=$1
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib; do
  [ -d "$d" ] && kiln_libpath=$kiln_libpath:$d
done
while read -r d; do kiln_libpath=$kiln_libpath:$d; done < <(python3 - 2>/dev/null <<'PY' || true
import glob, os, site
for sp in site.getsitepackages():
    for lib in glob.glob(os.path.join(sp, "nvidia", "**", "lib"), recursive=True):
        print(lib)
PY
)
export LD_LIBRARY_PATH=$kiln_libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
unset kiln_libpath
