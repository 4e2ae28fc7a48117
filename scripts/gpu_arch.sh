#!/usr/bin/env bash
# Prints the CUDA architectures of the GPUs nvidia-smi sees, as CMAKE_CUDA_ARCHITECTURES
# wants them (e.g. "90", or "80;90" on a mixed machine), or nothing when it sees none.
# build.sh and main_gpt.sh build for these, so that the Quick start works on any GPU and
# not only on the sm_90 (H100) that CMakeLists.txt defaults to.
set -uo pipefail
command -v nvidia-smi >/dev/null 2>&1 || exit 0
caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null) || exit 0
# Nothing usable (e.g. "[N/A]") prints nothing and still succeeds: callers run under set -e.
printf '%s\n' "$caps" | tr -d ' .' | grep -E '^[0-9]+$' | sort -un | paste -sd ';' - || true
