#!/usr/bin/env bash
# The precision-configuration comparison: trains a small GPT on Debian's fortunes corpus
# once per precision configuration (examples/gpt/train_gpt.cpp) and writes a table,
# summary.csv, results.json, loss_curves.png and memory.png.
#
#   scripts/main_gpt.sh                       defaults: a few minutes on 2 CPU cores
#   scripts/main_gpt.sh --configs all         every precision x ZeRO stage x offload
#   MPZERO_GPT_OUT=dir scripts/main_gpt.sh    where the outputs go (default results/gpt)
# Arguments go to train_gpt (--help lists them). Needs torch for python3 (scripts/setup.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${MPZERO_GPT_BUILD:-$root/build-gpt}"
results="${MPZERO_GPT_OUT:-$root/results/gpt}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

# The corpus, when missing. The package, not the directory:
# fortunes-min (which fortune-mod pulls in) fills the same directory with 3 small files.
# dpkg-query, not dpkg -s: a package removed but not purged still answers dpkg -s.
if ! dpkg-query -W -f='${Status}' fortunes 2>/dev/null | grep -q 'install ok installed'; then
  echo "main_gpt: installing Debian's fortunes (the training corpus)"
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fortunes >/dev/null
fi
# The PyPI packages come from scripts/setup.sh (which scripts/main.sh runs first).
for module in torch matplotlib; do
  if ! python3 -c "import $module" 2>/dev/null; then
    echo "main_gpt: $module for python3 is missing (torch: LibTorch for the engine; matplotlib: the plots);" \
      "run scripts/setup.sh first" >&2
    exit 1
  fi
done

# Only the trainer and the library it needs; with the engine's CUDA cores where there is
# a GPU to run them (nvidia-smi sees one) and nvcc to build them, so that train_gpt's
# --device auto trains there. Without a GPU they would only cost build time.
# Both flags every time: MPZERO_TORCH_CUDA is cached, and a build dir configured before a
# GPU (or nvcc) was there would otherwise keep training on the CPU.
cuda=(-DMPZERO_ENABLE_CUDA=OFF -DMPZERO_TORCH_CUDA=OFF)
nvcc_bin="$(command -v nvcc || true)"
[ -n "$nvcc_bin" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc_bin=/usr/local/cuda/bin/nvcc; }
# The CUDA cores need a CUDA build of torch too (a +cpu wheel has no libtorch_cuda), and
# are built for the GPUs that are there (scripts/gpu_arch.sh), not only for sm_90.
arch="$("$root/scripts/gpu_arch.sh")"
if [ -n "$nvcc_bin" ] && [ -n "$arch" ]; then
  if python3 -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
    echo "main_gpt: a GPU is present: building the engine's CUDA cores for it (sm_${arch//;/, sm_})"
    cuda=(-DMPZERO_ENABLE_CUDA=ON -DMPZERO_TORCH_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc_bin" "-DCMAKE_CUDA_ARCHITECTURES=$arch")
  else
    echo "main_gpt: a GPU is present, but python3's torch $(python3 -c 'import torch; print(torch.__version__)')" \
      "is a CPU-only build: training on the CPU (install a CUDA build of torch==2.11.0 to train on the GPU)"
  fi
fi
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DMPZERO_BUILD_BENCH=OFF -DMPZERO_BUILD_TESTS=OFF \
  "${cuda[@]}" >/dev/null
cmake --build "$build" --target train_gpt -j "$(nproc)"

# The trainer takes the last --out; the plots must read that one.
help=0
args=("$@")
for ((i = 0; i < ${#args[@]}; ++i)); do
  case "${args[i]}" in
    --help | -h) help=1 ;;
    --out) [ $((i + 1)) -lt ${#args[@]} ] && results="${args[i + 1]}" ;;
  esac
done
"$build/examples/train_gpt" --out "$results" "$@"
[ "$help" -eq 0 ] || exit 0
python3 "$root/examples/gpt/plot.py" "$results/results.json"

# What ZeRO is for: the ZeRO rows again at several world sizes (processes under mpirun, on
# the CPU), each rank's model states beside the memory model, held and at their peak
# (memory_by_world.csv and .png). Memory does not depend on the number of steps, so these
# runs are short; --persistence 0 partitions every parameter at stage 3. Your arguments
# come first (a larger model with --big, say); these flags take precedence.
# MPZERO_GPT_WORLDS="" skips them; the default is "1 2 4".
worlds="${MPZERO_GPT_WORLDS-1 2 4}"
zero_rows="fp32/z0,fp32/z1,fp32/z2,fp32/z3,bf16/z0,bf16/z1,bf16/z2,bf16/z3,bf16-all/z2,bf16-all/z3"
world_files=()
if [ -n "$worlds" ]; then
  if [ "${cuda[1]}" != "-DMPZERO_TORCH_CUDA=OFF" ]; then
    echo "main_gpt: the trainer runs on the GPU; the runs at several world sizes need one GPU per rank (NCCL)," \
      "which train_gpt does not set up: skipped"
  elif ! command -v mpirun >/dev/null 2>&1 || ! ldd "$build/examples/train_gpt" | grep -q libmpi; then
    echo "main_gpt: no MPI (Debian's openmpi-bin and libopenmpi-dev, which scripts/setup.sh installs): the runs" \
      "at several world sizes are skipped"
  else
    launcher=(mpirun --oversubscribe)
    [ "$(id -u)" -ne 0 ] || launcher+=(--allow-run-as-root)
    for w in $worlds; do
      echo
      echo "main_gpt: the ZeRO rows at world size $w"
      OMP_NUM_THREADS=1 "${launcher[@]}" -n "$w" "$build/examples/train_gpt" "$@" --configs "$zero_rows" \
        --steps 20 --persistence 0 --device cpu --out "$results/world$w"
      world_files+=("$results/world$w/results.json")
    done
    python3 "$root/examples/gpt/memory_by_world.py" "${world_files[@]}" --out "$results"
  fi
fi
echo
echo "main_gpt: outputs in $results:"
echo "  summary.csv   one row per configuration (the table above)"
echo "  results.json  the same plus every step's training loss"
echo "  loss_curves.png, memory.png"
if [ ${#world_files[@]} -gt 0 ]; then
  echo "  memory_by_world.csv, memory_by_world.png   the ZeRO rows at world sizes $worlds (runs in world<N>/)"
fi
