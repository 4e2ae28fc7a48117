#!/usr/bin/env bash
# Installs what mpzero's build, tests and main job need, skipping what is already there.
# Debian packages only (and, for the LibTorch adapter, PyPI's torch wheel when asked).
set -euo pipefail

packages=(cmake g++ make catch2 libbenchmark-dev nlohmann-json3-dev libopenmpi-dev openmpi-bin)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "mpzero setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "mpzero setup: note: nvcc is in /usr/local/cuda/bin but not on PATH; CUDA parts are found through CMake anyway"
fi
