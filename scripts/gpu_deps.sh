#!/usr/bin/env bash
# Prepares .deps/ (git-ignored) for a build on a machine that reaches no package
# registry, e.g. the lent GPU machine (docs/perf.md, "Running on a GPU"): downloads the
# Debian packages the build, tests, benchmarks and main job need and unpacks them under
# .deps/root (no root, no install). scripts/gpu_run.sh builds against them there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
deps="$root/.deps"
packages=(catch2 libbenchmark-dev libbenchmark1debian nlohmann-json3-dev fortunes fortunes-min)
mkdir -p "$deps/debs" "$deps/root"
cd "$deps/debs"
for p in "${packages[@]}"; do
  ls "$p"_*.deb >/dev/null 2>&1 || apt-get download "$p"
done
for d in *.deb; do dpkg -x "$d" "$deps/root"; done
du -sh "$deps/root"
echo "gpu_deps: unpacked ${#packages[@]} packages under $deps/root"
