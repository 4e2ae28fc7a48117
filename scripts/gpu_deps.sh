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
updated=0
for p in "${packages[@]}"; do
  ls "$p"_*.deb >/dev/null 2>&1 && continue
  # A machine whose packages all came preinstalled may never have fetched the lists.
  if [ "$updated" -eq 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq || echo "gpu_deps: apt-get update failed; trying the download with the lists there are" >&2
    updated=1
  fi
  apt-get download "$p"
done
for d in *.deb; do dpkg -x "$d" "$deps/root"; done
du -sh "$deps/root"
echo "gpu_deps: unpacked ${#packages[@]} packages under $deps/root"
