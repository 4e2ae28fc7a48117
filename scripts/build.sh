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
# Compiles through ccache when it is installed (scripts/setup.sh installs it): a rebuild
# after a fresh clone or a touched header recompiles only the units whose preprocessed
# input changed. CCACHE_BASEDIR makes the paths under this tree relative, so clones in
# other directories share the cache. MPZERO_CCACHE=0, or a launcher in the arguments, turns
# it off.
launcher=()
if [ "${MPZERO_CCACHE:-1}" != "0" ] && command -v ccache >/dev/null 2>&1 && [[ " $* " != *COMPILER_LAUNCHER* ]]; then
  via="/usr/bin/env;CCACHE_BASEDIR=$root;$(command -v ccache)"
  launcher=("-DCMAKE_CXX_COMPILER_LAUNCHER=$via" "-DCMAKE_CUDA_COMPILER_LAUNCHER=$via")
fi
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release "${cuda_flag[@]}" "${launcher[@]}" "$@" >/dev/null
cmake --build "$root/build" -j "$(nproc)"
