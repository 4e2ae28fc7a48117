#!/usr/bin/env bash
# Installs what mpzero's build, tests and main job need, skipping what is already there:
# Debian packages (ccache: scripts/build.sh compiles through it), PyPI's torch wheel for
# the LibTorch adapter (pinned; the same version the GPU machines have), matplotlib (the
# main job's plots, which its tests draw too) and safetensors, which the tests read
# exported files with.
# MPZERO_NO_TORCH=1 skips the PyPI packages (the adapter and the main job are then not
# built). Arguments name further Debian packages to install the same way (scripts/fuzz.sh:
# clang).
set -euo pipefail
torch_version="2.11.0"
safetensors_version="0.8.0"

packages=(cmake g++ make ccache python3 python3-pip catch2 libbenchmark-dev nlohmann-json3-dev libopenmpi-dev openmpi-bin "$@")
missing=()
for p in "${packages[@]}"; do
  # dpkg-query, not dpkg -s: a package removed but not purged still answers dpkg -s.
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "mpzero setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "mpzero setup: note: nvcc is in /usr/local/cuda/bin but not on PATH; CUDA parts are found through CMake anyway"
fi

if [ "${MPZERO_NO_TORCH:-0}" != "1" ]; then
  have=$(python3 -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
  if [ "$have" != "$torch_version" ]; then
    if [ -n "$have" ]; then
      echo "mpzero setup: python3 has torch $have; replacing it with torch==$torch_version, the version the adapter is" \
        "built and tested against (set MPZERO_NO_TORCH=1 to keep yours and skip the adapter)"
    fi
    echo "mpzero setup: installing torch==$torch_version from PyPI (LibTorch for the adapter; a download of a few GB)"
    # Debian's own python3 refuses pip installs (PEP 668) unless told otherwise.
    python3 -m pip install -q "torch==$torch_version" 2>/dev/null ||
      python3 -m pip install -q --break-system-packages "torch==$torch_version"
  fi
  # matplotlib: the main job draws its plots with it, and so do its tests (examples.main_job).
  if ! python3 -c "import matplotlib" 2>/dev/null; then
    echo "mpzero setup: installing matplotlib from PyPI (the main job's plots)"
    python3 -m pip install -q matplotlib 2>/dev/null || python3 -m pip install -q --break-system-packages matplotlib
  fi
  # safetensors: the tests read the fp32 export's .safetensors files with it, as a user would.
  # Optional: without it that test says so and reads the .pt files only, so a failed
  # install (no PyPI) warns instead of stopping the setup.
  if ! python3 -c "import safetensors" 2>/dev/null; then
    echo "mpzero setup: installing safetensors==$safetensors_version from PyPI (the tests read exported files with it)"
    python3 -m pip install -q "safetensors==$safetensors_version" 2>/dev/null ||
      python3 -m pip install -q --break-system-packages "safetensors==$safetensors_version" ||
      echo "mpzero setup: warning: safetensors could not be installed; the fp32 export test will read .pt files only" >&2
  fi
fi
