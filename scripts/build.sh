#!/usr/bin/env bash
# Configures and builds mpzero into build/ (Release). Extra arguments go to cmake.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cuda_flag=()
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  cuda_flag=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
# With a GPU here, build the CUDA parts for it (CMakeLists.txt defaults to sm_90), unless
# the arguments choose.
arch="$("$root/scripts/gpu_arch.sh")"
if [ -n "$arch" ] && [[ " $* " != *CMAKE_CUDA_ARCHITECTURES* ]]; then
  echo "mpzero build: building the CUDA parts for this machine's GPUs (CMAKE_CUDA_ARCHITECTURES=$arch)"
  cuda_flag+=("-DCMAKE_CUDA_ARCHITECTURES=$arch")
fi
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release "${cuda_flag[@]}" "$@" >/dev/null
cmake --build "$root/build" -j "$(nproc)"
