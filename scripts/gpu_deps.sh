#!/usr/bin/env bash
# Prepares .deps/ (git-ignored) for building or running mpzero's GPU suite on a machine
# without the Debian development packages it needs, or without a package registry
# (scripts/gpu_run.sh uses .deps/ when it is there): downloads those packages where apt
# works and unpacks them under .deps/root, with no root and no install. Copy .deps/ to
# the GPU machine's checkout when it cannot download them itself.
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
