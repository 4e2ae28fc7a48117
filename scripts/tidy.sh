#!/usr/bin/env bash
# clang-tidy (checks in .clang-tidy) over the translation units that instantiate the core:
# the core's tests, the config parser and the fuzz targets, with the library's headers
# (include/mpzero, adapters/torch) reported wherever they are instantiated. Needs a
# configured build folder with compile_commands.json (default build/, which
# scripts/build.sh makes). 9-11 minutes on 2 cores; not part of CI.
#   scripts/tidy.sh [BUILD_DIR]        exit status 1 when there is a warning
# Left out: test_numeric.cpp (clang 14 has no _Float16 on x86-64, which it compares
# against) and the LibTorch units (LibTorch's headers take most of the time, and
# nothing of ours is instantiated there that these units do not).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
[ -f "$build/compile_commands.json" ] || {
  echo "tidy: $build/compile_commands.json is missing: configure the build first (scripts/build.sh)" >&2
  exit 2
}
tidy="$(command -v clang-tidy || true)"
[ -n "$tidy" ] || { echo "tidy: clang-tidy is not installed (apt-get install clang-tidy)" >&2; exit 2; }
units=(tests/test_zero.cpp tests/test_zero_wire.cpp tests/test_checkpoint.cpp tests/test_fused_step.cpp
       tests/test_kernel_threads.cpp tests/test_comm.cpp tests/test_partition.cpp tests/test_plan.cpp
       tests/test_optim_a.cpp tests/test_optim_b.cpp tests/test_loss_scaler.cpp tests/test_simd.cpp
       tests/test_config.cpp adapters/torch/src/config.cpp fuzz/fuzz_checkpoint.cpp fuzz/fuzz_config.cpp)
logs="$build/tidy"
rm -rf "$logs" && mkdir -p "$logs"
cd "$root"
printf '%s\n' "${units[@]}" |
  xargs -P "$(nproc)" -I{} sh -c '"$0" -p "$1" --quiet "$2" >"$3/$(basename "$2").log" 2>&1 || true' "$tidy" "$build" {} "$logs"
# One line per warning, however many units instantiate it; a unit clang-tidy could not
# process ("Error while processing": a compile error) counts as one too.
found="$(cat "$logs"/*.log | grep -E "(warning|error): |Error while processing" | sort -u || true)"
if [ -n "$found" ]; then
  echo "$found"
  echo "tidy: $(echo "$found" | wc -l) warning(s); logs in $logs" >&2
  exit 1
fi
echo "tidy: no warnings in ${#units[@]} units ($("$tidy" --version | grep -o 'version [0-9.]*'))"
