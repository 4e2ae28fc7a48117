#!/usr/bin/env bash
# Packages this checkout with Conan 2 and runs test_package/ against the package:
#
#   scripts/conan_check.sh [SCRATCH_DIR]
#
# Installs PyPI's conan for python3 when no `conan` is on PATH, and creates a default
# profile (`conan profile detect`) when the Conan home has none. The recipe, its
# test_package/ and the files it exports are copied to SCRATCH_DIR (default: a fresh
# temporary folder) first, so that `conan create` writes nothing into the checkout.
# CONAN_HOME, when set, selects the cache (the CTest test packaging.conan_create uses
# one inside the build tree); otherwise Conan's own default (~/.conan2) is used.
# Works offline once conan is installed: the recipe has no requirements, and no remote
# is asked.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

if ! command -v conan >/dev/null 2>&1; then
  echo "conan_check: conan not found; installing PyPI's conan for $(command -v python3)"
  python3 -m pip install --quiet --break-system-packages conan 2>/dev/null ||
    python3 -m pip install --quiet conan
  # pip may put the script where PATH does not look: the interpreter's scripts folder,
  # or the user's (~/.local/bin).
  if ! command -v conan >/dev/null 2>&1; then
    scripts_dirs="$(python3 -c 'import os, site, sysconfig
print(sysconfig.get_path("scripts") + os.pathsep + os.path.join(site.USER_BASE, "bin"))')"
    export PATH="$scripts_dirs:$PATH"
  fi
  command -v conan >/dev/null 2>&1 || { echo "conan_check: conan still not on PATH after pip install" >&2; exit 1; }
fi
conan --version

if [ -n "${CONAN_HOME:-}" ]; then mkdir -p "$CONAN_HOME"; fi
if ! conan profile path default >/dev/null 2>&1; then
  conan profile detect
fi

scratch="${1:-}"
if [ -z "$scratch" ]; then
  scratch="$(mktemp -d)"
  trap 'rm -rf "$scratch"' EXIT
fi
rm -rf "$scratch/recipe"
mkdir -p "$scratch/recipe"
(cd "$root" && cp -R conanfile.py test_package CMakeLists.txt cmake include LICENSE "$scratch/recipe/")
# Nothing a local build left in test_package/ travels with it.
rm -rf "$scratch/recipe/test_package/build" "$scratch/recipe/test_package/CMakeUserPresets.json"

cd "$scratch/recipe"
version="$(conan inspect . --format=json | python3 -c 'import json, sys; print(json.load(sys.stdin)["version"])')"
echo "conan_check: mpzero/$version from $root"
# --no-remote: the recipe requires nothing, so no remote is asked (this also runs offline).
conan create . --build=missing --no-remote 2>&1 | tee "$scratch/conan_create.log"
grep -q "mpzero $version test_package: ok" "$scratch/conan_create.log" ||
  { echo "conan_check: test_package did not report success" >&2; exit 1; }
echo "conan_check: ok (mpzero/$version packaged, test_package built with find_package(mpzero) and ran)"
