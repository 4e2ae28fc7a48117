#!/usr/bin/env bash
# Runs the CPU tests under AddressSanitizer and UndefinedBehaviorSanitizer
# (docs/architecture.md, "Sanitizers and fuzzing"): builds the core's tests, the config
# parser's and the fuzz targets' replays with g++ -fsanitize=address,undefined into
# build-asan/, then `ctest -LE gpu` there. Any report fails its test: UBSan does not
# recover, and LeakSanitizer checks every process at exit (OpenMPI's own allocations
# are suppressed by scripts/lsan.supp).
#
#   scripts/sanitize.sh [extra ctest arguments, e.g. -R zero]
#
# Not built here: the CUDA parts, the benchmarks, the examples and the LibTorch engine
# (LibTorch itself is not instrumented). About 20 minutes to build on 2 cores, 10 to test.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
MPZERO_NO_TORCH=1 "$root/scripts/setup.sh"
build="$root/build-asan"
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
# Python3 is not looked for, so LibTorch is not found: the adapter builds its
# torch-free config parser only.
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DMPZERO_ENABLE_CUDA=OFF -DMPZERO_BUILD_BENCH=OFF \
  -DMPZERO_BUILD_EXAMPLES=OFF -DMPZERO_INSTALL=OFF -DCMAKE_DISABLE_FIND_PACKAGE_Python3=ON >/dev/null
cmake --build "$build" -j "$(nproc)"
cd "$build"
# Full stacks for leaks (fast unwinding stops inside OpenMPI's plugins, whose frames the
# suppressions then cannot name).
export ASAN_OPTIONS="${ASAN_OPTIONS:-fast_unwind_on_malloc=0}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$root/scripts/lsan.supp:print_suppressions=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
ctest --output-on-failure -j "$(nproc)" -LE gpu "$@"
