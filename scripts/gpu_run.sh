#!/usr/bin/env bash
# Builds and runs mpzero's GPU suite on a machine with an NVIDIA GPU, and collects the
# results in one folder:
#
#   scripts/gpu_run.sh [--out DIR] [PHASE ...]        (default phases: build test bench)
#
# DIR defaults to results/gpu in the checkout; it gets the logs (machine.txt,
# configure.log, build.log, ctest_gpu.log) and each phase's results. The phases:
#   build   configure + build the [gpu] tests, the CUDA benchmark and train_gpt (build-gpu/)
#   test    ctest -L gpu (every [gpu] case: kernels vs host, ZeRO on CUDA + NCCL, offload
#           transfers, the LibTorch engine on CUDA parameters)
#   bench   mpzero_bench_cuda (the step per policy vs the device copy bandwidth;
#           bench_cuda.json, which bench/copy_share.py reads)
#   gpt     train_gpt --device cuda (the precision comparison); GPT_ARGS adds flags,
#           GPT_NAME names the run (default gpt; results under DIR/$GPT_NAME)
#   states  train_gpt again, on a model whose memory is mostly model states (STATES_ARGS,
#           default below; results under DIR/states): the memory and step-time targets
#   peers   bench/peers.py --device cuda: mpzero's CUDA step beside torch's fused, foreach
#           and for-loop AdamW, DeepSpeed's FusedAdam, torchao, TransformerEngine's
#           FusedAdam and bitsandbytes (those installed, or carried as wheels in .whl/ by
#           scripts/gpu_wheels.sh: installed into .gpu/site first), with the copy baseline;
#           GPU_RUN_PEERS_ARGS adds flags (default below); peers_cuda.{json,txt,md,png};
#           under GPU_RUN_TIME_LIMIT_S no row starts that would not end in time (--stop-by)
#   overhead  mpzero_bench_engine's overhead/*/cuda rows: the engine against plain LibTorch
#           with its fused AdamW on a 134M-parameter MLP (engine_overhead_cuda.json)
#   seeds   train_gpt once per seed of GPU_RUN_SEEDS (default "1 2 3 4 5") with SEEDS_ARGS
#           (default below; results under DIR/seeds/seed<N>), then
#           examples/gpt/compare_seeds.py over the seeds done so far (seeds/summary.json):
#           the stochastic-rounding loss criterion, judged on paired per-seed changes;
#           GPU_RUN_SEEDS_JOBS of them at a time (default 1); GPU_RUN_SEEDS_PRIOR=FILE (a
#           summary such as docs/data/seeds_big_cosine.json; a relative path is from the
#           checkout) adds this run's seeds to that series (seeds/merged.{txt,json})
# e.g.  scripts/gpu_run.sh      then      GPT_ARGS="--big --steps 1000" scripts/gpu_run.sh gpt states
#
# Each phase builds what it needs first (a no-op when build-gpu/ is up to date); the
# first build of a run builds the targets of all its phases in one parallel build. A
# phase that fails is reported and the next one still runs; the exit status is the
# number of failed phases. GPU_RUN_TIME_LIMIT_S (default: none) bounds the whole run: a
# phase still running at its end is stopped, the rest are skipped, no seed is started
# that would not end in time, and what was written so far (logs, train_gpt's
# results.json, which it rewrites after each configuration) stays in DIR.
# GPU_RUN_CTEST_J runs that many test programs side by side (default 1);
# GPU_RUN_BENCH_ARGS adds flags to mpzero_bench_cuda (e.g. --benchmark_filter=tuning).
#
# Libraries: the build uses the machine's packages (Catch2 v2, Google Benchmark,
# nlohmann-json, fortunes; scripts/setup.sh installs them on Debian), or .deps/ when it
# is there: scripts/gpu_deps.sh unpacks those packages into .deps/ without installing
# them, for a GPU machine without development packages or a package registry. It needs
# nvcc, CMake and python3 with a CUDA build of torch (its LibTorch; pip's nvidia-nccl
# wheel serves as NCCL when the toolkit has none).
#
# Prebuilt (GPU_RUN_PREBUILT=1): runs an offline bundle made on another machine by
# scripts/gpu_pack.sh (copy its .gpu/build-gpu.tar.xz, and .deps/, into this checkout;
# this script unpacks it), with no configure and no build here; a phase whose program is
# not in the bundle fails. The bundle's CTest files name the paths of the machine that
# built it: they are linked to this checkout when absent.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ "${1:-}" = "--out" ]; then
  [ $# -ge 2 ] || { echo "gpu_run: --out needs a folder" >&2; exit 2; }
  GPU_RUN_OUT="$2"
  shift 2
fi
work="${GPU_RUN_OUT:-$root/results/gpu}"
mkdir -p "$work"
work="$(cd "$work" && pwd)"
export GPU_RUN_OUT="$work"  # the phases run this script again (--one)
build="$root/build-gpu"
prebuilt="${GPU_RUN_PREBUILT:-0}"
# The packages unpacked by scripts/gpu_deps.sh, else the machine's own.
deps="$root/.deps/root/usr"
prefix=/usr
[ -d "$deps" ] && prefix="$deps"
if [ "$prebuilt" = 1 ]; then
  # The bundle as scripts/gpu_pack.sh compresses it: unpacked with python3's tarfile, as
  # a GPU machine's image may have no xz. Again whenever the archive is newer than what
  # an earlier run unpacked; into a fresh folder first, so that an interrupted unpack
  # never passes for a whole one.
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
    echo "gpu_run: GPU_RUN_PREBUILT=1 but $build has no build: make a bundle with scripts/gpu_pack.sh where it was built and copy .gpu/build-gpu.tar.xz here" >&2
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
  [ -d "$deps" ] && extra_libs="$deps/lib/x86_64-linux-gnu:$extra_libs"
  export LD_LIBRARY_PATH="${extra_libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
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
# Targets that failed to build earlier in this run (the loop below starts it empty and
# passes it to each phase; a phase run alone with --one starts the same file afresh):
# later phases report them instead of compiling the failing file again.
if [ -n "${GPU_RUN_FAILED:-}" ]; then
  failed_list="$GPU_RUN_FAILED"
else
  failed_list="$work/failed_targets"
  rm -f "$failed_list"  # a fresh list: no stale entries from an earlier run
fi
all_targets=(test_gpu test_zero_gpu test_comm_gpu test_torch_gpu mpzero_bench_cuda train_gpt mpzero_peers_step_cuda
  mpzero_bench_engine)
test_targets=(test_gpu test_zero_gpu test_comm_gpu test_torch_gpu)
# The states run: about 151M parameters, 4 x 128 tokens a step, so that model states
# (not activations) dominate peak memory, as in the DeepSpeed blog's 7B model.
default_states_args="--big --dim 1024 --layers 12 --heads 16 --seq 128 --batch 4 --steps 200 \
--configs bf16/z2,bf16-all-ac/z2,bf16-all/z2,fp16-master/z2,torch"
# The seeds run: 1000 steps on the --big model, the fp32 baseline first, at the cosine
# rate that decides the loss criterion (a constant rate's per-seed spread is 20 times
# wider: docs/perf.md, "GPT comparison on the GPU: held-out loss after 1000 steps").
default_seeds_args="--big --steps 1000 --lr-schedule cosine --configs fp32/z0,bf16/z2,bf16-all-sr/z2"
# The peers run: every configuration, size and layout, 9 rounds.
default_peers_args="--rounds 9"
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
    echo "packages: $prefix"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  } >"$work/machine.txt" 2>&1
  [ "$prebuilt" = 1 ] && return 0
  local gen=()  # a generator only for a new build folder (an existing one keeps its own)
  [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  local dep_flags=()  # the packages of .deps/, when there
  [ -d "$deps" ] && dep_flags=(-DCMAKE_PREFIX_PATH="$deps" -Dbenchmark_DIR="$deps/lib/x86_64-linux-gnu/cmake/benchmark")
  if ! cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${dep_flags[@]}" \
    -DCMAKE_CUDA_COMPILER="$nvcc_bin" -DMPZERO_TORCH_CUDA=ON -DPython3_EXECUTABLE="$(command -v python3)" \
    "${cxx_flags[@]}" >"$work/configure.log" 2>&1; then
    tail -30 "$work/configure.log"
    return 1
  fi
  grep "mpzero:" "$work/configure.log"
}

# Builds the named targets, together with the other phases' of this run
# (GPU_RUN_TARGETS, set by the loop below) in one parallel build, leaving out (and
# reporting) any this configuration does not define (no NCCL, no LibTorch found) and
# any that failed earlier in this run, and going on past failures. Succeeds when the
# named ones built. A target that fails is recorded, so that no later phase compiles
# its failing file again (a long nvcc error costs minutes per try): a failing file is
# compiled once by the build and once more per target that needs it.
ensure_built() {
  configure || return 1
  local defined=() t
  if [ "$prebuilt" = 1 ]; then
    local ok=0
    for t in "$@"; do
      # A program is named as its target, a shared library lib<target>.so.
      if [ -z "$(find -L "$build" -type f \( -name "$t" -o -name "lib$t.so" \) -perm -u+x -print -quit)" ]; then
        echo "gpu_run: $t is not in the prebuilt bundle (scripts/gpu_pack.sh)"
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
  # The tests that built still run, but a test program that is not
  # defined (test_zero_gpu needs NCCL) or did not build fails the phase, and so does a
  # label that matches no test.
  local built=0
  ensure_built "${test_targets[@]}" || built=1
  [ "$built" -eq 0 ] || echo "gpu_run: not every [gpu] test program built (see build.log); running those that did"
  # A program that did not build is left out: a stale binary of it must not run instead.
  local skip=() t exclude=()
  for t in "${test_targets[@]}"; do grep -qx "$t" "$failed_list" 2>/dev/null && skip+=("$t"); done
  [ ${#skip[@]} -gt 0 ] && exclude=(-E "^($(IFS='|'; echo "${skip[*]}"))\\.")
  # One hung test must not hold the run: a stuck collective raises mpzero's own error
  # (naming the collective) at 60 s, before ctest's 240 s kill; NCCL's warnings go to
  # the log.
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
# The peers' table and plot from their results file (rewritten after every row).
render_peers() {
  python3 "$root/bench/peers_render.py" "$work/peers_cuda.json" --markdown --plot "$work/peers_cuda.png" \
    >"$work/peers_cuda.md" 2>&1
}
phase_peers() {
  ensure_built mpzero_peers_step_cuda || return 1
  local lib
  lib="$(find -L "$build" -type f -name libmpzero_peers_step_cuda.so -print -quit)"
  # The peers carried as wheels (scripts/gpu_wheels.sh), installed beside the machine's
  # own packages, never over them.
  if ls "$root"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$root/.gpu/site" "$root"/.whl/*.whl \
      >"$work/peers_wheels.log" 2>&1 || {
      tail -5 "$work/peers_wheels.log"
      echo "gpu_run: the wheels in .whl/ do not install here; make them for this machine's Python with" \
        "scripts/gpu_wheels.sh --python-version $(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
      return 1
    }
    export PYTHONPATH="$root/.gpu/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # Under a time limit no row starts that would not end in time, and the table is made.
  local stop=()
  [ -n "${GPU_RUN_PHASE_END:-}" ] && stop=(--stop-by "$((GPU_RUN_PHASE_END - 20))")
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 python3 "$root/bench/peers.py" --device cuda --lib "$lib" --out "$work/peers_cuda.json" "${stop[@]}" \
    ${GPU_RUN_PEERS_ARGS:-$default_peers_args} 2>&1 | tee "$work/peers_cuda.txt" | grep -E "^\[[0-9]+/[0-9]+\] ==|^peers.py|mpzero  |differs|error|warning" | tail -80
  local rc=${PIPESTATUS[0]}
  if [ -f "$work/peers_cuda.json" ]; then
    render_peers
    cat "$work/peers_cuda.md"
  fi
  return "$rc"
}
phase_overhead() {
  ensure_built mpzero_bench_engine || return 1
  "$build/bench/mpzero_bench_engine" --benchmark_filter='^overhead/.*/cuda' --benchmark_repetitions=7 \
    --benchmark_enable_random_interleaving=true --benchmark_min_time=1 --benchmark_report_aggregates_only=true \
    --benchmark_out="$work/engine_overhead_cuda.json" --benchmark_out_format=json 2>&1 | tee "$work/engine_overhead_cuda.txt"
  local rc=${PIPESTATUS[0]}
  # The rows exist only where LibTorch sees a CUDA device.
  if ! grep -q '"name": "overhead/engine/mlp_4096x8/cuda' "$work/engine_overhead_cuda.json" 2>/dev/null; then
    echo "gpu_run: mpzero_bench_engine ran no overhead/*/cuda row: its LibTorch sees no CUDA device"
    return 1
  fi
  return "$rc"
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
# each, so that a run the time limit stops still leaves its summary.
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
  # docs/data/seeds_big_cosine.json), also this run's seeds added to it.
  local prior="${GPU_RUN_SEEDS_PRIOR:-}"
  [ -n "$prior" ] && [ "${prior#/}" = "$prior" ] && prior="$root/$prior"  # relative to the checkout
  [ ${#runs[@]} -gt 0 ] && [ -n "$prior" ] && python3 "$root/examples/gpt/compare_seeds.py" \
    "$prior" "${runs[@]}" --json "$work/seeds/merged.json" >"$work/seeds/merged.txt" 2>&1
  return 0
}
phase_seeds() {
  ensure_built train_gpt || return 1
  # This run's seeds only, not an earlier run's results and summary.
  rm -rf "$work/seeds"
  mkdir -p "$work/seeds"
  # GPU_RUN_SEEDS_JOBS seeds train side by side on the one GPU (default 1), for a model
  # too small to fill the GPU alone (the --big model fills an H100 by itself). Their
  # steps/s then mean nothing; their losses are the same as alone.
  local jobs_max="${GPU_RUN_SEEDS_JOBS:-1}" seed
  local threads=$(( $(nproc) / jobs_max ))
  [ "$threads" -ge 1 ] || threads=1
  # With a time limit, no seed starts that would not finish before it (GPU_RUN_PHASE_END,
  # set by the loop below), judged by the longest seed so far: a seed stopped halfway is
  # GPU time spent for nothing.
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
  [ -n "$skipped" ] && echo "-- seeds not started (a seed takes up to $seeds_longest s, more than the time limit left):$skipped"
  cat "$work/seeds/summary.txt" 2>/dev/null
  [ -n "${GPU_RUN_SEEDS_PRIOR:-}" ] && { echo "-- with $GPU_RUN_SEEDS_PRIOR:"; cat "$work/seeds/merged.txt" 2>/dev/null; }
  for seed in ${GPU_RUN_SEEDS:-1 2 3 4 5}; do
    case " $skipped " in *" $seed "*) continue ;; esac
    [ "$(cat "$work/seeds/seed$seed.rc" 2>/dev/null)" = 0 ] || return 1
  done
  return 0
}

# At the end (or on an interrupt): the plots of a training phase that the time limit
# stopped, and where the results are.
finish() {
  local name
  for name in "${GPT_NAME:-gpt}" states; do
    # A training phase stopped early left results.json without its plots.
    if [ -f "$work/$name/results.json" ] && [ "$work/$name/results.json" -nt "$work/$name/memory.png" ]; then
      python3 "$root/examples/gpt/plot.py" "$work/$name/results.json" 2>&1 | tail -2
    fi
  done
  # The peers' table, when their phase was stopped before it made it.
  if [ -f "$work/peers_cuda.json" ] && [ "$work/peers_cuda.json" -nt "$work/peers_cuda.md" ]; then render_peers; fi
  echo "== gpu_run: results in $work"
}

# One phase, run by the loop below under `timeout` (which stops the phase's whole
# process group: the build, ctest, train_gpt).
if [ "${1:-}" = "--one" ]; then
  "phase_$2"
  exit $?
fi

[ $# -gt 0 ] || set -- build test bench
GPU_RUN_TARGETS=""
for p in "$@"; do
  case "$p" in
    build) GPU_RUN_TARGETS+=" ${all_targets[*]}" ;;
    test) GPU_RUN_TARGETS+=" ${test_targets[*]}" ;;
    bench) GPU_RUN_TARGETS+=" mpzero_bench_cuda" ;;
    gpt | states | seeds) GPU_RUN_TARGETS+=" train_gpt" ;;
    peers) GPU_RUN_TARGETS+=" mpzero_peers_step_cuda" ;;
    overhead) GPU_RUN_TARGETS+=" mpzero_bench_engine" ;;
    *) echo "gpu_run: unknown phase '$p' (build, test, bench, peers, overhead, gpt, states, seeds)" >&2; exit 2 ;;
  esac
done
export GPU_RUN_TARGETS
export GPU_RUN_FAILED="$work/failed_targets"
rm -f "$GPU_RUN_FAILED"
limit="${GPU_RUN_TIME_LIMIT_S:-}"
# timeout puts the phase in a process group of its own: pass an interrupt of this script
# (Ctrl-C, a scheduler's stop) on to it, so no build or train_gpt outlives the run.
tpid=""
trap '[ -n "$tpid" ] && kill -TERM -- "-$tpid" 2>/dev/null; finish; exit 130' INT TERM
for p in "$@"; do
  left=0  # timeout's 0: no limit
  if [ -n "$limit" ]; then
    left=$((limit - SECONDS))
    if [ "$left" -le 10 ]; then
      echo "== gpu_run: $p SKIPPED: the time limit of $limit s (GPU_RUN_TIME_LIMIT_S) is reached" >&2
      failed=$((failed + 1))
      continue
    fi
    echo "== gpu_run: $p ($(date -u +%H:%M:%S), $left s of the time limit left)"
    export GPU_RUN_PHASE_END=$(( $(date +%s) + left ))
  else
    echo "== gpu_run: $p ($(date -u +%H:%M:%S))"
  fi
  timeout -k 10 "$left" "$BASH" "$root/scripts/gpu_run.sh" --one "$p" &
  tpid=$!
  wait "$tpid"
  rc=$?
  tpid=""
  if [ -n "$limit" ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
    echo "== gpu_run: $p STOPPED at the time limit ($limit s, GPU_RUN_TIME_LIMIT_S)" >&2
    failed=$((failed + 1))
  elif [ "$rc" -ne 0 ]; then
    echo "== gpu_run: $p FAILED" >&2
    failed=$((failed + 1))
  fi
done
finish
exit "$failed"
