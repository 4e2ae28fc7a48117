#!/usr/bin/env bash
# On a GPU machine that reaches no package registry (the lent H100/H200): builds mpzero
# against .deps/ (made beforehand by scripts/gpu_deps.sh where apt works, carried over),
# then runs the phases named on the command line:
#   build   configure + build the [gpu] tests, the CUDA benchmark and train_gpt (build-gpu/)
#   test    ctest -L gpu (every [gpu] case: kernels vs host, ZeRO on CUDA + NCCL, offload
#           transfers, the LibTorch engine on CUDA parameters)
#   bench   mpzero_bench_cuda (the step per policy vs the device copy bandwidth)
#   gpt     train_gpt --device cuda (the precision comparison); GPT_ARGS adds flags,
#           GPT_NAME names the run (default gpt; results under <work>/$GPT_NAME)
#   states  train_gpt again, on a model whose memory is mostly model states (STATES_ARGS,
#           default below; results under <work>/states): the memory and step-time targets
#   seeds   train_gpt once per seed of GPU_RUN_SEEDS (default "1 2 3 4 5") with SEEDS_ARGS
#           (default below; results under <work>/seeds/seed<N>), then
#           examples/gpt/compare_seeds.py over the seeds done so far (seeds/summary.json):
#           the stochastic-rounding loss criterion, judged on paired per-seed changes;
#           GPU_RUN_SEEDS_JOBS of them at a time (default 1); no seed starts that the
#           budget would stop before it ends (judged by the longest seed so far);
#           GPU_RUN_SEEDS_PRIOR=FILE (a summary; a relative path is from the checkout) adds this
#           call's seeds to an earlier series (seeds/merged.{txt,json})
# e.g.  scripts/gpu_run.sh build test bench      then      GPT_ARGS="--big --steps 1000" scripts/gpu_run.sh gpt states
#
# Each phase builds what it needs first (a no-op when build-gpu/ is up to date), so a
# call on a fresh machine works whatever ran before; the first build of a call builds
# the targets of all its phases in one parallel build. Logs and results go to a work
# folder (out/gpu); when $OUT is set (the device tool, which brings back at most 8
# files), they are packed there as one gpu_run.tar.gz, beside copies of the main
# results (results.json, the plots, bench_cuda.json).
# A phase that fails is reported and the next one still runs; the exit status is the
# number of failed phases. The device tool ends a call at 10 minutes and brings back only
# what is under $OUT by then, so the phases share a budget (GPU_RUN_BUDGET_S, default
# 540 s from the start of the script): a phase still running at its end is stopped, the
# rest are skipped, and what was written so far (logs, train_gpt's results.json, which it
# rewrites after each configuration) is still packed.
#
# Prebuilt (GPU_RUN_PREBUILT=1): the GPU targets were built elsewhere for sm_90 and
# packed by scripts/gpu_pack.sh into .gpu/build-gpu and .gpu/build-gpu.tar.xz (carry
# ".gpu/build-gpu.tar.xz" and ".deps"; this script unpacks it), so a
# lent machine spends its minutes running them, not compiling them: no configure and no
# build here; a phase whose program is not in the pack fails. The pack's CTest files name
# the paths of the machine that built it: they are linked to this checkout when absent.
# GPU_RUN_CTEST_J runs that many test programs side by side (default 1);
# GPU_RUN_BENCH_ARGS adds flags to mpzero_bench_cuda (e.g. --benchmark_filter=tuning).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$root/out/gpu"
prefix="$root/.deps/root/usr"
build="$root/build-gpu"
prebuilt="${GPU_RUN_PREBUILT:-0}"
mkdir -p "$work"
if [ ! -d "$prefix" ]; then
  echo "gpu_run: $prefix is missing: run scripts/gpu_deps.sh where apt works and carry .deps" >&2
  exit 1
fi
if [ "$prebuilt" = 1 ]; then
  # The pack as scripts/gpu_pack.sh compresses it (what a call carries): unpacked with
  # python3's tarfile, as the GPU machine's image may have no xz. Again whenever the
  # archive is newer than what a warm machine kept from an earlier call; into a fresh
  # folder first, so that an interrupted unpack never passes for a whole one.
  pack="$root/.gpu/build-gpu.tar.xz"
  if [ -f "$pack" ] && { [ ! -f "$root/.gpu/build-gpu/CMakeCache.txt" ] || [ "$pack" -nt "$root/.gpu/build-gpu/CMakeCache.txt" ]; }; then
    rm -rf "$root/.gpu/unpack" && mkdir -p "$root/.gpu/unpack" &&
      python3 -c 'import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    t.extractall(sys.argv[2], **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))' "$pack" "$root/.gpu/unpack" &&
      touch "$root/.gpu/unpack/build-gpu/CMakeCache.txt" && rm -rf "$root/.gpu/build-gpu" &&
      mv "$root/.gpu/unpack/build-gpu" "$root/.gpu/build-gpu" && rm -rf "$root/.gpu/unpack" ||
      { echo "gpu_run: cannot unpack $pack" >&2; exit 1; }
  fi
  if [ ! -e "$build" ] && [ -d "$root/.gpu/build-gpu" ]; then ln -s "$root/.gpu/build-gpu" "$build"; fi
  if [ ! -f "$build/CMakeCache.txt" ]; then
    echo "gpu_run: GPU_RUN_PREBUILT=1 but $build has no build: run scripts/gpu_pack.sh where it was built and carry .gpu" >&2
    exit 1
  fi
  # The builder's source and build folders, as its CTest files and rpaths name them.
  for key in CMAKE_HOME_DIRECTORY CMAKE_CACHEFILE_DIR; do
    was="$(sed -n "s/^$key:INTERNAL=//p" "$build/CMakeCache.txt")"
    here="$root"
    [ "$key" = CMAKE_CACHEFILE_DIR ] && here="$build"
    if [ -n "$was" ] && [ ! -e "$was" ]; then mkdir -p "$(dirname "$was")" && ln -s "$here" "$was"; fi
  done
fi
# Shared libraries: .deps (Google Benchmark), then LibTorch's and pip's NCCL and the
# toolkit's, for programs built elsewhere whose rpaths name another machine's folders.
if [ -z "${GPU_RUN_LIBS:-}" ]; then  # once: the phases run this script again (--one)
  extra_libs="$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null || true)"
  nccl_lib="$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)/lib"
  [ -d "$nccl_lib" ] && extra_libs="$extra_libs:$nccl_lib"
  [ -d /usr/local/cuda/lib64 ] && extra_libs="$extra_libs:/usr/local/cuda/lib64"
  export LD_LIBRARY_PATH="$prefix/lib/x86_64-linux-gnu:${extra_libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export GPU_RUN_LIBS=1
fi
nvcc_bin="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
# NCCL: the toolkit's, else pip's nvidia-nccl wheel (what a PyTorch image may have; its
# package has no __init__.py, hence __path__).
if [ -z "${NCCL_HOME:-}" ] && [ ! -e "$(dirname "$(dirname "$nvcc_bin")")/include/nccl.h" ]; then
  nccl_py="$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)"
  [ -n "$nccl_py" ] && [ -e "$nccl_py/include/nccl.h" ] && export NCCL_HOME="$nccl_py"
fi
# cuBLAS/cuSPARSE/cuSOLVER headers (LibTorch's CUDA headers include them, e.g. through
# ProcessGroupNCCL.hpp in the engine's [gpu] test; only C++ files include LibTorch):
# the toolkit's, else pip's CUDA wheels', searched with -idirafter, after every other
# folder, so that the toolkit's own CUDA runtime headers still come first (CPATH would
# put pip's copies before the toolkit's -isystem folder).
cuda_include="$(dirname "$(dirname "$nvcc_bin")")/include"
cxx_flags=()
if [ ! -e "$cuda_include/cublas_v2.h" ]; then
  cu_py="$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)/cu13/include"
  [ -e "$cu_py/cublas_v2.h" ] && cxx_flags=("-DCMAKE_CXX_FLAGS=-idirafter $cu_py")
fi
# Targets that failed to build earlier in this call (the loop below starts it empty and
# passes it to each phase; a phase run alone with --one starts the same file afresh):
# later phases report them instead of compiling the failing file again.
if [ -n "${GPU_RUN_FAILED:-}" ]; then
  failed_list="$GPU_RUN_FAILED"
else
  failed_list="$work/failed_targets"
  rm -f "$failed_list"  # a fresh list: no stale entries from an earlier call
fi
all_targets=(test_gpu test_zero_gpu test_comm_gpu test_torch_gpu mpzero_bench_cuda train_gpt)
test_targets=(test_gpu test_zero_gpu test_comm_gpu test_torch_gpu)
# The states run: about 151M parameters, 4 x 128 tokens a step, so that model states
# (not activations) dominate peak memory, as in the DeepSpeed blog's 7B model.
default_states_args="--big --dim 1024 --layers 12 --heads 16 --seq 128 --batch 4 --steps 200 \
--configs bf16/z2,bf16-all-ac/z2,bf16-all/z2,fp16-master/z2,torch"
# The seeds run: the issue's 1000 steps on the --big model, the fp32 baseline first, at
# the cosine rate that decides the loss criterion (docs/perf.md, session 27: a constant
# rate's per-seed spread is 20 times wider).
default_seeds_args="--big --steps 1000 --lr-schedule cosine --configs fp32/z0,bf16/z2,bf16-all-sr/z2"
failed=0

# Configures build-gpu/ (again: cheap when it exists, and it refreshes a stale cache).
configure() {
  [ -f "$work/machine.txt" ] || {
    nvidia-smi
    echo "nvcc: $nvcc_bin"; "$nvcc_bin" --version | tail -2
    cmake --version | head -1; g++ --version | head -1
    python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
    echo "NCCL_HOME=${NCCL_HOME:-}"
    echo "extra configure flags: ${cxx_flags[*]:-none}"
    for h in cublas_v2.h cublasLt.h cusparse.h cusolverDn.h; do
      [ -e "$cuda_include/$h" ] && echo "toolkit has $h" || echo "toolkit lacks $h"
    done
    echo "prebuilt: $prebuilt"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  } >"$work/machine.txt" 2>&1
  [ "$prebuilt" = 1 ] && return 0
  local gen=()  # a generator only for a new build folder (an existing one keeps its own)
  [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  if ! cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
    -DCMAKE_CUDA_COMPILER="$nvcc_bin" -DMPZERO_TORCH_CUDA=ON -DPython3_EXECUTABLE="$(command -v python3)" \
    -Dbenchmark_DIR="$prefix/lib/x86_64-linux-gnu/cmake/benchmark" "${cxx_flags[@]}" >"$work/configure.log" 2>&1; then
    tail -30 "$work/configure.log"
    return 1
  fi
  grep "mpzero:" "$work/configure.log"
}

# Builds the named targets, together with the other phases' of this call
# (GPU_RUN_TARGETS, set by the loop below) in one parallel build, leaving out (and
# reporting) any this configuration does not define (no NCCL, no LibTorch found) and
# any that failed earlier in this call, and going on past failures. Succeeds when the
# named ones built. A target that fails is recorded, so that no later phase compiles
# its failing file again (each try of a long nvcc error costs minutes of the budget):
# a failing file is compiled once by the build and once more per target that needs it.
ensure_built() {
  configure || return 1
  local defined=() t
  if [ "$prebuilt" = 1 ]; then
    local ok=0
    for t in "$@"; do
      if [ -z "$(find -L "$build" -type f -name "$t" -perm -u+x -print -quit)" ]; then
        echo "gpu_run: $t is not in the prebuilt pack (scripts/gpu_pack.sh)"
        echo "$t" >>"$failed_list"
        ok=1
      fi
    done
    return "$ok"
  fi
  # shellcheck disable=SC2086
  for t in $(printf '%s\n' "$@" ${GPU_RUN_TARGETS:-} | sort -u); do
    if grep -qx "$t" "$failed_list" 2>/dev/null; then
      continue
    elif [ -n "$(find "$build" -type d -name "$t.dir" -print -quit)" ]; then
      defined+=("$t")
    else
      echo "gpu_run: target $t is not defined in this configuration (see configure.log)"
    fi
  done
  local built=0
  if [ ${#defined[@]} -gt 0 ]; then
    local keep_going=(-- -k)
    [ -f "$build/build.ninja" ] && keep_going=(-- -k 0)
    if ! cmake --build "$build" -j "$(nproc)" --target "${defined[@]}" "${keep_going[@]}" >>"$work/build.log" 2>&1; then
      grep -E "error|Error" "$work/build.log" | head -20
      built=1
    fi
  fi
  # After a failed build, find which targets did not build, each by building it alone
  # (a no-op for one that built; a dry run cannot tell, as it always sees CMake's glob
  # check as work): every target of the build, so that later phases skip the failures.
  local ok=0
  if [ "$built" -ne 0 ]; then
    for t in "${defined[@]}"; do
      cmake --build "$build" -j "$(nproc)" --target "$t" >>"$work/build.log" 2>&1 || echo "$t" >>"$failed_list"
    done
  fi
  for t in "$@"; do
    if grep -qx "$t" "$failed_list" 2>/dev/null; then
      echo "gpu_run: $t did not build (see build.log)"
      ok=1
    elif ! printf '%s\n' "${defined[@]}" | grep -qx "$t"; then
      ok=1
    fi
  done
  return "$ok"
}

phase_build() {
  ensure_built "${all_targets[@]}"
}
phase_test() {
  # The tests that built still run (GPU time is scarce), but a test program that is not
  # defined (test_zero_gpu needs NCCL) or did not build fails the phase, and so does a
  # label that matches no test.
  local built=0
  ensure_built "${test_targets[@]}" || built=1
  [ "$built" -eq 0 ] || echo "gpu_run: not every [gpu] test program built (see build.log); running those that did"
  # A program that did not build is left out: a stale binary of it must not run instead.
  local skip=() t exclude=()
  for t in "${test_targets[@]}"; do grep -qx "$t" "$failed_list" 2>/dev/null && skip+=("$t"); done
  [ ${#skip[@]} -gt 0 ] && exclude=(-E "^($(IFS='|'; echo "${skip[*]}"))\\.")
  # Below the device tool's 10 minutes a call: one hung test must not take the call down.
  # A stuck collective raises mpzero's own error (naming the call) at 60 s, before
  # ctest's 240 s kill; NCCL's warnings go to the log.
  (cd "$build" && MPZERO_COMM_TIMEOUT_S=60 NCCL_DEBUG=WARN ctest -L gpu "${exclude[@]}" --no-tests=error \
    --output-on-failure --timeout 240 -j "${GPU_RUN_CTEST_J:-1}") 2>&1 | tee "$work/ctest_gpu.log" | tail -40
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] && rc=$built
  return "$rc"
}
phase_bench() {
  ensure_built mpzero_bench_cuda || return 1
  # shellcheck disable=SC2086
  "$build/bench/mpzero_bench_cuda" --benchmark_out="$work/bench_cuda.json" --benchmark_out_format=json \
    --benchmark_min_time=0.2 ${GPU_RUN_BENCH_ARGS:-} 2>&1 | tee "$work/bench_cuda.txt" | tail -60
  return "${PIPESTATUS[0]}"
}
phase_gpt() {
  ensure_built train_gpt || return 1
  local name="${GPT_NAME:-gpt}"
  # shellcheck disable=SC2086
  "$build/examples/train_gpt" --device cuda --corpus "$prefix/share/games/fortunes" --out "$work/$name" ${GPT_ARGS:-} \
    2>"$work/${name}_progress.log" | tee "$work/$name.txt"
  local rc=${PIPESTATUS[0]}
  tail -3 "$work/${name}_progress.log"
  [ "${GPT_PLOT:-1}" = 1 ] && [ -f "$work/$name/results.json" ] && python3 "$root/examples/gpt/plot.py" "$work/$name/results.json" 2>&1 | tail -2
  return "$rc"
}
phase_states() {
  GPT_NAME=states GPT_ARGS="${STATES_ARGS:-$default_states_args}" phase_gpt
}
# One seed's training run (seeds/seed<N>), its exit status left in seeds/seed<N>.rc.
run_seed() {
  local rc=0
  date +%s >"$work/seeds/seed$1.start"
  GPT_PLOT=0 GPT_NAME="seeds/seed$1" GPT_ARGS="${SEEDS_ARGS:-$default_seeds_args} --seed $1" phase_gpt >/dev/null || rc=$?
  echo "$rc" >"$work/seeds/seed$1.rc"
}
# The seeds that finished, each reported once, and the summary over them, rewritten after
# each, so that a run the budget stops still leaves its summary.
seeds_reported=" "
seeds_longest=0  # seconds, the longest finished seed so far
seeds_summarize() {
  local seed rc runs=() took
  for seed in ${GPU_RUN_SEEDS:-1 2 3 4 5}; do
    rc="$(cat "$work/seeds/seed$seed.rc" 2>/dev/null)" || continue
    took=$(( $(stat -c %Y "$work/seeds/seed$seed.rc") - $(cat "$work/seeds/seed$seed.start") ))
    [ "$rc" = 0 ] && [ "$took" -gt "$seeds_longest" ] && seeds_longest=$took
    [ "$rc" = 0 ] && runs+=("$work/seeds/seed$seed/results.json")  # only runs that finished
    case "$seeds_reported" in *" $seed "*) continue ;; esac
    seeds_reported+="$seed "
    echo "-- seed $seed: $([ "$rc" = 0 ] && echo "done in $took s" || echo "FAILED ($rc)"): $(tail -c 400 "$work/seeds/seed${seed}_progress.log" 2>/dev/null | tr '\r' '\n' | grep -v '^ *$' | tail -1)"
  done
  [ ${#runs[@]} -gt 0 ] && python3 "$root/examples/gpt/compare_seeds.py" "${runs[@]}" \
    --json "$work/seeds/summary.json" >"$work/seeds/summary.txt" 2>&1
  # With an earlier series (GPU_RUN_SEEDS_PRIOR: a compare_seeds summary, e.g.
  # docs/data/seeds_big_constant.json), also this call's seeds added to it.
  local prior="${GPU_RUN_SEEDS_PRIOR:-}"
  [ -n "$prior" ] && [ "${prior#/}" = "$prior" ] && prior="$root/$prior"  # relative to the checkout
  [ ${#runs[@]} -gt 0 ] && [ -n "$prior" ] && python3 "$root/examples/gpt/compare_seeds.py" \
    "$prior" "${runs[@]}" --json "$work/seeds/merged.json" >"$work/seeds/merged.txt" 2>&1
  return 0
}
phase_seeds() {
  ensure_built train_gpt || return 1
  # This call's seeds only: a warm machine keeps an earlier call's results and summary.
  rm -rf "$work/seeds"
  mkdir -p "$work/seeds"
  # GPU_RUN_SEEDS_JOBS seeds train side by side on the one GPU (default 1), for a model
  # too small to fill the GPU alone (the --big model fills an H100: no gain, session 22's
  # docs/perf.md). Their steps/s then mean nothing; their losses are the same as alone.
  local jobs_max="${GPU_RUN_SEEDS_JOBS:-1}" seed
  local threads=$(( $(nproc) / jobs_max ))
  [ "$threads" -ge 1 ] || threads=1
  # No seed starts that would not finish before the budget's end (GPU_RUN_PHASE_END, set
  # by the loop below), judged by the longest seed so far: a seed stopped halfway is
  # device time spent for nothing.
  local skipped=""
  for seed in ${GPU_RUN_SEEDS:-1 2 3 4 5}; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; seeds_summarize; done
    if [ -n "$skipped" ] || { [ -n "${GPU_RUN_PHASE_END:-}" ] && [ "$seeds_longest" -gt 0 ] &&
      [ $(( $(date +%s) + seeds_longest )) -gt "$GPU_RUN_PHASE_END" ]; }; then
      skipped+=" $seed"
      continue
    fi
    OMP_NUM_THREADS="$threads" run_seed "$seed" &
  done
  while [ "$(jobs -rp | wc -l)" -gt 0 ]; do wait -n; seeds_summarize; done
  seeds_summarize
  [ -n "$skipped" ] && echo "-- seeds not started (a seed takes up to $seeds_longest s, more than the budget had left):$skipped"
  cat "$work/seeds/summary.txt" 2>/dev/null
  [ -n "${GPU_RUN_SEEDS_PRIOR:-}" ] && { echo "-- with $GPU_RUN_SEEDS_PRIOR:"; cat "$work/seeds/merged.txt" 2>/dev/null; }
  for seed in ${GPU_RUN_SEEDS:-1 2 3 4 5}; do
    case " $skipped " in *" $seed "*) continue ;; esac
    [ "$(cat "$work/seeds/seed$seed.rc" 2>/dev/null)" = 0 ] || return 1
  done
  return 0
}

# Everything in one archive under $OUT, plus the main results as files of their own
# (at most 8: the archive, bench_cuda.json, three per training run).
bring_back() {
  local name f
  for name in "${GPT_NAME:-gpt}" states; do
    # A training phase stopped by the budget left results.json without its plots.
    if [ -f "$work/$name/results.json" ] && [ "$work/$name/results.json" -nt "$work/$name/memory.png" ]; then
      python3 "$root/examples/gpt/plot.py" "$work/$name/results.json" 2>&1 | tail -2
    fi
  done
  [ -n "${OUT:-}" ] || return 0
  tar -czf "$OUT/gpu_run.tar.gz" -C "$root/out" gpu 2>/dev/null
  [ -f "$work/bench_cuda.json" ] && cp "$work/bench_cuda.json" "$OUT/"
  for name in "${GPT_NAME:-gpt}" states; do
    for f in "$work/$name/results.json" "$work/$name/loss_curves.png" "$work/$name/memory.png"; do
      [ -f "$f" ] && cp "$f" "$OUT/${name}_$(basename "$f")"
    done
  done
  # The tool brings back 8 files at most; the archive holds this summary too.
  [ -f "$work/seeds/summary.json" ] && [ "$(ls "$OUT" | wc -l)" -lt 8 ] && cp "$work/seeds/summary.json" "$OUT/seeds_summary.json"
  ls "$OUT"
}

# One phase, run by the loop below under `timeout` (which stops the phase's whole
# process group: the build, ctest, train_gpt).
if [ "${1:-}" = "--one" ]; then
  "phase_$2"
  exit $?
fi

[ $# -gt 0 ] || set -- build test
GPU_RUN_TARGETS=""
for p in "$@"; do
  case "$p" in
    build) GPU_RUN_TARGETS+=" ${all_targets[*]}" ;;
    test) GPU_RUN_TARGETS+=" ${test_targets[*]}" ;;
    bench) GPU_RUN_TARGETS+=" mpzero_bench_cuda" ;;
    gpt | states | seeds) GPU_RUN_TARGETS+=" train_gpt" ;;
    *) echo "gpu_run: unknown phase '$p' (build, test, bench, gpt, states, seeds)" >&2; exit 2 ;;
  esac
done
export GPU_RUN_TARGETS
export GPU_RUN_FAILED="$work/failed_targets"
rm -f "$GPU_RUN_FAILED"
budget="${GPU_RUN_BUDGET_S:-540}"
# timeout puts the phase in a process group of its own: pass an interrupt of this script
# (Ctrl-C, the device tool's stop) on to it, so no build or train_gpt outlives the call.
tpid=""
trap '[ -n "$tpid" ] && kill -TERM -- "-$tpid" 2>/dev/null; bring_back; exit 130' INT TERM
for p in "$@"; do
  left=$((budget - SECONDS))
  if [ "$left" -le 10 ]; then
    echo "== gpu_run: $p SKIPPED: the budget of $budget s (GPU_RUN_BUDGET_S) is spent" >&2
    failed=$((failed + 1))
    continue
  fi
  echo "== gpu_run: $p ($(date -u +%H:%M:%S), $left s of the budget left)"
  GPU_RUN_PHASE_END=$(( $(date +%s) + left )) timeout -k 10 "$left" "$BASH" "$root/scripts/gpu_run.sh" --one "$p" &
  tpid=$!
  wait "$tpid"
  rc=$?
  tpid=""
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "== gpu_run: $p STOPPED at the end of the budget ($budget s, GPU_RUN_BUDGET_S)" >&2
    failed=$((failed + 1))
  elif [ "$rc" -ne 0 ]; then
    echo "== gpu_run: $p FAILED" >&2
    failed=$((failed + 1))
  fi
done
bring_back
exit "$failed"
