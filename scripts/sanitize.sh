#!/usr/bin/env bash
# Runs the CPU tests under AddressSanitizer and UndefinedBehaviorSanitizer
# (docs/architecture.md, "Sanitizers and fuzzing"): builds the core's tests, the config
# parser's and the fuzz targets' replays with g++ -fsanitize=address,undefined into
# build-asan/, then `ctest -LE gpu` there. Any report fails its test: UBSan does not
# recover, and LeakSanitizer checks every process at exit (OpenMPI's own allocations
# are suppressed by scripts/lsan.supp).
#
#   scripts/sanitize.sh [--torch] [extra ctest arguments, e.g. -R zero]
#
# --torch builds into build-asan-torch/ instead, with the LibTorch engine and its tests
# (LibTorch itself is not instrumented; mpzero's code in and around it is). Never built
# here: the CUDA parts, the benchmarks and the examples. On 2 cores: about 20 minutes to
# build and 4 to test; --torch about 12 and 3 more.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
with_torch=0
if [ "${1:-}" = "--torch" ]; then
  with_torch=1
  shift
fi
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
common=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined"
  -DMPZERO_ENABLE_CUDA=OFF -DMPZERO_BUILD_BENCH=OFF -DMPZERO_BUILD_EXAMPLES=OFF -DMPZERO_INSTALL=OFF)
if [ "$with_torch" = 1 ]; then
  "$root/scripts/setup.sh"
  build="$root/build-asan-torch"
  cmake -S "$root" -B "$build" "${common[@]}" >/dev/null
else
  MPZERO_NO_TORCH=1 "$root/scripts/setup.sh"
  build="$root/build-asan"
  # Python3 is not looked for, so LibTorch is not found: the adapter builds its
  # torch-free config parser only.
  cmake -S "$root" -B "$build" "${common[@]}" -DCMAKE_DISABLE_FIND_PACKAGE_Python3=ON >/dev/null
fi
cmake --build "$build" -j "$(nproc)"
cd "$build"
# Full stacks for leaks (fast unwinding stops inside OpenMPI's plugins, whose frames the
# suppressions then cannot name).
export ASAN_OPTIONS="${ASAN_OPTIONS:-fast_unwind_on_malloc=0}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$root/scripts/lsan.supp:print_suppressions=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
ctest --output-on-failure -j "$(nproc)" -LE gpu "$@"
