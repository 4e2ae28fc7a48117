#!/usr/bin/env bash
# Coverage-guided fuzzing of the checkpoint reader and the JSON config parser
# (fuzz/, docs/testing.md): builds the fuzz targets with clang, libFuzzer, ASan and UBSan
# into build-fuzz/, writes the checkpoint target's seeds (real checkpoints at 1-3 ranks),
# and runs each target for SECONDS (default 60) on the machine's cores.
#
#   scripts/fuzz.sh [SECONDS] [config|checkpoint ...]
#
# What a target finds lands in build-fuzz/findings/<target>/ (crash-*, leak-*, timeout-*),
# and the run ends non-zero; replay one with `build-fuzz/fuzz/fuzz_<target> FILE`.
# New inputs that reached new code are kept in build-fuzz/corpus/<target>/ across runs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
seconds="${1:-60}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
  echo "scripts/fuzz.sh: SECONDS must be a positive integer, not '$seconds' (usage: scripts/fuzz.sh [SECONDS] [config|checkpoint ...])" >&2
  exit 2
fi
shift $(( $# > 0 ? 1 : 0 ))
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(config checkpoint)
for t in "${targets[@]}"; do
  case "$t" in
    config | checkpoint) ;;
    *) echo "scripts/fuzz.sh: no fuzz target '$t'; the targets are config and checkpoint" >&2; exit 2 ;;
  esac
done

# clang (its libFuzzer runtime comes with it) and the libraries the targets use (no
# LibTorch: the config parser is torch-free).
MPZERO_NO_TORCH=1 "$root/scripts/setup.sh" clang

build="$root/build-fuzz"
flags="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DMPZERO_FUZZ=ON -DMPZERO_ENABLE_CUDA=OFF \
  -DMPZERO_BUILD_BENCH=OFF -DMPZERO_BUILD_EXAMPLES=OFF -DMPZERO_INSTALL=OFF \
  -DCMAKE_DISABLE_FIND_PACKAGE_Python3=ON >/dev/null
build_targets=()
for t in "${targets[@]}"; do build_targets+=("fuzz_$t"); done
[[ " ${targets[*]} " == *" checkpoint "* ]] && build_targets+=(fuzz_checkpoint_seeds)
cmake --build "$build" -j "$(nproc)" --target "${build_targets[@]}"

export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
mpi_flags=(--oversubscribe)
[ "$(id -u)" -ne 0 ] || mpi_flags+=(--allow-run-as-root)
status=0
for t in "${targets[@]}"; do
  corpus="$build/corpus/$t"
  findings="$build/findings/$t"
  mkdir -p "$corpus" "$findings"
  seeds=("$root/fuzz/corpus/$t")
  if [ "$t" = checkpoint ]; then
    seeds=("$build/seeds/checkpoint")
    # (OpenMPI's own allocations at exit are not ours to report: scripts/lsan.supp.)
    ASAN_OPTIONS=fast_unwind_on_malloc=0 LSAN_OPTIONS="suppressions=$root/scripts/lsan.supp:print_suppressions=0" \
      OMP_NUM_THREADS=1 \
      mpirun -np 3 "${mpi_flags[@]}" "$build/fuzz/fuzz_checkpoint_seeds" "${seeds[0]}"
  fi
  echo "mpzero fuzz: $t for $seconds s ($(nproc) jobs); findings in $findings"
  # -fork: one process per core, restarted after a finding so the run goes on; the
  # findings are kept all the same and make the exit status non-zero.
  if ! OMP_NUM_THREADS=1 "$build/fuzz/fuzz_$t" "$corpus" "${seeds[@]}" -max_total_time="$seconds" \
      -fork="$(nproc)" -ignore_crashes=1 -artifact_prefix="$findings/" -print_final_stats=1 \
      > "$build/fuzz-$t.log" 2>&1; then
    status=1
  fi
  tail -n 5 "$build/fuzz-$t.log"
  if compgen -G "$findings/*" >/dev/null; then
    echo "mpzero fuzz: $t FOUND $(ls "$findings" | wc -l) failing input(s) in $findings (log: $build/fuzz-$t.log)"
    status=1
  else
    echo "mpzero fuzz: $t: no findings in $seconds s (corpus: $(ls "$corpus" | wc -l) inputs)"
  fi
done
exit $status
