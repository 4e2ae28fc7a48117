#!/usr/bin/env bash
# Quick start, command 2: install what is missing, build, run every test.
# Without a GPU the [gpu] tests are built but not run (ctest -LE gpu); with one, all run.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
cd "$root/build"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  ctest --output-on-failure -j 2
else
  echo "mpzero: no GPU here: running every test but the [gpu] ones (they are built; run 'ctest -L gpu' on a GPU machine)"
  ctest --output-on-failure -j 2 -LE gpu
fi
