#!/usr/bin/env bash
# Collects the peers of bench/peers.py --device cuda as wheels in .whl/ (git-ignored),
# for a GPU machine that has torch but no package registry; scripts/gpu_run.sh's peers
# phase installs whatever .whl/ holds (pip --no-index, into .gpu/site) before it runs:
#
#   scripts/gpu_wheels.sh [--python-version 3.12] [--cuda 13.0] [--no-bnb]
#
#   deepspeed   built here from PyPI's source with DS_BUILD_OPS=0: a pure-Python wheel
#               that compiles its fused_adam op with ninja and nvcc on first use (there,
#               for the GPU's own architecture: about a minute), plus hjson and pydantic,
#               which a CUDA image with torch rarely has
#   torchao     the version installed here, else the newest
#   bitsandbytes  repacked with the native library of one CUDA version only (--cuda, by
#               default torch's here): 5 MB instead of 43
#
# TransformerEngine is not collected: its PyTorch extension (transformer_engine_torch)
# has no binary wheel on PyPI, and transformer_engine_cu13 alone is 276 MB. Where TE is
# installed, bench/peers.py runs it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.whl"
pyver=3.12
bnb=1
cuda="$(python3 -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || true)"
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) pyver="$2"; shift 2 ;;
    --cuda) cuda="$2"; shift 2 ;;
    --no-bnb) bnb=0; shift ;;
    *) echo "gpu_wheels: unknown argument '$1' (--python-version X.Y, --cuda X.Y, --no-bnb)" >&2; exit 2 ;;
  esac
done
mkdir -p "$dest"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# Binary wheels for the GPU machine's Python (not this one's).
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "$@"
}
# The versions installed here (read from their metadata: importing deepspeed prints), else the newest.
installed() { python3 -c 'import sys, importlib.metadata as m; print(m.version(sys.argv[1]))' "$1" 2>/dev/null || true; }
ds_version="$(installed deepspeed)"
if ! ls "$dest"/deepspeed-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "deepspeed${ds_version:+==$ds_version}"
  tar -C "$tmp" -xzf "$tmp"/deepspeed-*.tar.gz
  # No op is compiled here (DS_BUILD_OPS=0, no accelerator probed): the wheel is pure Python.
  (cd "$tmp"/deepspeed-*/ && DS_BUILD_OPS=0 DS_ACCELERATOR=cpu python3 -m pip wheel -q --no-deps \
    --no-build-isolation -w "$dest" .)
fi
download hjson "pydantic>=2" pydantic-core annotated-types typing-inspection
ao_version="$(installed torchao)"
download "torchao${ao_version:+==$ao_version}"
if [ "$bnb" = 1 ]; then
  [ -n "$cuda" ] || { echo "gpu_wheels: no CUDA version for bitsandbytes' library: give --cuda X.Y (torch's)" >&2; exit 2; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_24_x86_64 -d "$tmp" bitsandbytes
  # The wheel carries a native library per CUDA, ROCm and XPU version; one is loaded, the
  # one of torch's CUDA. The others, and their lines in RECORD, are left out.
  python3 - "$tmp"/bitsandbytes-*.whl "$dest" "$cuda" <<'PY'
import os, re, sys, zipfile
src, out, cuda = sys.argv[1], sys.argv[2], sys.argv[3].replace(".", "")
keep = re.compile(rf"libbitsandbytes_(cpu|cuda{cuda})\.so$")
drop = lambda name: re.search(r"libbitsandbytes_\w+\.so$", name) and not keep.search(name)
dst = os.path.join(out, os.path.basename(src))
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    names = zin.namelist()
    if not any(keep.search(n) and "cuda" in n for n in names):
        sys.exit(f"gpu_wheels: {os.path.basename(src)} has no library for CUDA {sys.argv[3]}")
    for name in names:
        if drop(name):
            continue
        data = zin.read(name)
        if name.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if not drop(l.split(b",")[0].decode()))
        zout.writestr(zin.getinfo(name), data)
print(f"gpu_wheels: {os.path.basename(dst)} with the libraries of CUDA {sys.argv[3]} and the CPU only")
PY
fi
ls -la "$dest"
du -sh "$dest"
