#!/usr/bin/env bash
# Quick start, command 1: install what is missing, build, run the main job: the
# precision-configuration comparison (a small GPT trained through the mpzero engine once
# per precision configuration; table, CSV, JSON and plots in results/gpt).
# Arguments go to the trainer (--help lists them; --configs all for every combination).
# On a machine with a GPU (and nvcc) it trains there; --device cpu forces the CPU.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/setup.sh"
exec "$root/scripts/main_gpt.sh" "$@"
