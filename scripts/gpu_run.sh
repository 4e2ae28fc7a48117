#!/usr/bin/env bash
# On a GPU machine that reaches no package registry (the lent H100/H200): builds mpzero
# against .deps/ (made beforehand by scripts/gpu_deps.sh where apt works, carried over),
# then runs the phases named on the command line, each logging under $OUT (default
# out/gpu):
#   build   configure + build the [gpu] tests, the CUDA benchmarks, train_gpt (build-gpu/)
#   test    ctest -L gpu (every [gpu] case: kernels vs host, ZeRO on CUDA + NCCL, offload
#           transfers, the LibTorch engine on CUDA parameters)
#   bench   mpzero_bench_cuda (the step per policy vs the device copy bandwidth)
#   gpt     train_gpt --device cuda (the precision comparison); GPT_ARGS adds flags
# e.g.  scripts/gpu_run.sh build test     then    GPT_ARGS="--big --steps 1000" scripts/gpu_run.sh gpt
# A phase that fails is reported and the next one still runs; the exit status is the
# number of failed phases.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-$root/out/gpu}"
prefix="$root/.deps/root/usr"
build="$root/build-gpu"
mkdir -p "$out"
if [ ! -d "$prefix" ]; then
  echo "gpu_run: $prefix is missing: run scripts/gpu_deps.sh where apt works and carry .deps" >&2
  exit 1
fi
export LD_LIBRARY_PATH="$prefix/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvcc_bin="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
# NCCL: the toolkit's, else pip's nvidia-nccl wheel (what a PyTorch image may have).
if [ -z "${NCCL_HOME:-}" ] && [ ! -e "$(dirname "$(dirname "$nvcc_bin")")/include/nccl.h" ]; then
  nccl_py="$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null || true)"
  [ -n "$nccl_py" ] && [ -e "$nccl_py/include/nccl.h" ] && export NCCL_HOME="$nccl_py"
fi
failed=0

phase_build() {
  nvidia-smi >"$out/nvidia-smi.txt" 2>&1
  local gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
    -DCMAKE_CUDA_COMPILER="$nvcc_bin" -DMPZERO_TORCH_CUDA=ON >"$out/configure.log" 2>&1 || return 1
  grep "mpzero:" "$out/configure.log"
  # One target at a time: a target this configuration does not define (no NCCL, no
  # LibTorch found) must not keep the others from building.
  local rc=0 t
  : >"$out/build.log"
  for t in test_gpu test_zero_gpu test_comm_gpu test_torch_gpu mpzero_bench_cuda train_gpt; do
    if cmake --build "$build" -j "$(nproc)" --target "$t" >>"$out/build.log" 2>&1; then
      echo "built $t"
    else
      echo "FAILED to build $t (see build.log)"
      rc=1
    fi
  done
  return $rc
}
phase_test() {
  (cd "$build" && ctest -L gpu --output-on-failure --timeout 600) 2>&1 | tee "$out/ctest_gpu.log" | tail -40
  return "${PIPESTATUS[0]}"
}
phase_bench() {
  "$build/bench/mpzero_bench_cuda" --benchmark_out="$out/bench_cuda.json" --benchmark_out_format=json \
    --benchmark_min_time=0.2 2>&1 | tee "$out/bench_cuda.txt" | tail -60
  return "${PIPESTATUS[0]}"
}
phase_gpt() {
  # shellcheck disable=SC2086
  "$build/examples/train_gpt" --device cuda --corpus "$prefix/share/games/fortunes" --out "$out/gpt" ${GPT_ARGS:-} \
    2>"$out/gpt_progress.log" | tee "$out/gpt.txt"
  local rc=${PIPESTATUS[0]}
  tail -3 "$out/gpt_progress.log"
  python3 "$root/examples/gpt/plot.py" "$out/gpt/results.json" 2>&1 | tail -2
  return "$rc"
}

[ $# -gt 0 ] || set -- build test
for p in "$@"; do
  case "$p" in
    build | test | bench | gpt) ;;
    *) echo "gpu_run: unknown phase '$p' (build, test, bench, gpt)" >&2; exit 2 ;;
  esac
  echo "== gpu_run: $p ($(date -u +%H:%M:%S))"
  if ! "phase_$p"; then
    echo "== gpu_run: $p FAILED" >&2
    failed=$((failed + 1))
  fi
done
exit "$failed"
