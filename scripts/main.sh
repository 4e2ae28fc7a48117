#!/usr/bin/env bash
# Quick start, command 1: install what is missing, build, run the main job.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
exec "$root/build/examples/precision_demo" "$@"
