#!/usr/bin/env bash
# Quick start, command 1: install what is missing, build, run the main job: the
# precision-configuration comparison (a small GPT trained through the mpzero engine once
# per precision configuration; table, CSV, JSON and plots in results/gpt).
# Arguments go to the trainer (--help lists them; --configs all for every combination).
# The engine trains CPU tensors in this version, so it runs on the CPU even where a GPU is.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/setup.sh"
exec "$root/scripts/main_gpt.sh" "$@"
