#!/usr/bin/env bash
# Prepares an offline bundle of mpzero's GPU programs: built on a development machine,
# to run on a GPU machine that cannot build them itself (no development packages, no
# package registry, or no time for a build of several minutes); scripts/gpu_run.sh with
# GPU_RUN_PREBUILT=1 runs the bundle. On the development machine (nvcc, and PyPI's CUDA
# build of torch at the version the GPU machine has):
#
#   cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
#         -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON -DMPZERO_BENCH_NATIVE=OFF -DMPZERO_TORCH_CUDA=ON
#   cmake --build build-gpu --target test_gpu test_zero_gpu test_comm_gpu test_torch_gpu mpzero_bench_cuda train_gpt \
#         mpzero_peers_step_cuda mpzero_bench_engine
#   scripts/gpu_pack.sh [BUILD_DIR]          (default build-gpu)
#
# No MPI (a GPU machine without development packages has none to link) and no
# -march=native (its CPU may be another); CMAKE_CUDA_ARCHITECTURES names its GPU. The
# bundle, .gpu/build-gpu (git-ignored), is the build folder without objects and static
# libraries: the programs (stripped), CMakeCache.txt and the CTest files; and the same
# compressed as .gpu/build-gpu.tar.xz (a few MB). Copy that archive, and .deps/ from
# scripts/gpu_deps.sh, into a checkout on the GPU machine, then:
#
#   GPU_RUN_PREBUILT=1 scripts/gpu_run.sh test bench
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
src="${1:-$root/build-gpu}"
dst="$root/.gpu/build-gpu"
[ -f "$src/CMakeCache.txt" ] || { echo "gpu_pack: $src is not a build folder" >&2; exit 1; }
if [ -f "$src/examples/train_gpt" ] && ldd "$src/examples/train_gpt" | grep -q libmpi; then
  echo "gpu_pack: $src links MPI, which the GPU machine lacks: configure it with -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON" >&2
  exit 1
fi
rm -rf "$dst"
mkdir -p "$dst"
tar -C "$src" --exclude='*.o' --exclude='*.a' --exclude='.ninja*' --exclude='build.ninja' --exclude='CMakeFiles' -cf - . |
  tar -C "$dst" -xf -
# Executables without their symbol tables (nothing here is debugged there).
find "$dst" -type f -perm -u+x -exec sh -c 'file -b "$1" | grep -q ELF && strip --strip-unneeded "$1"' _ {} \;
du -sh "$dst"
tar -C "$root/.gpu" -cf - build-gpu | xz -T0 -6 >"$dst.tar.xz.tmp"
mv "$dst.tar.xz.tmp" "$dst.tar.xz"
du -sh "$dst.tar.xz"
find "$dst" -type f -perm -u+x -size +1M -exec ls -la {} \; | awk '{print $5, $9}'
