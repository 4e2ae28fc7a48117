#!/usr/bin/env bash
# Checks the vcpkg port (ports/mpzero) without vcpkg: does what its portfile does with
# plain CMake, then builds and runs a consumer through find_package(mpzero).
#
#   scripts/vcpkg_check.sh [SCRATCH_DIR]
#
# 1. ports/mpzero/vcpkg.json's version is the one include/mpzero/config.hpp defines.
# 2. Configures this checkout with the OPTIONS of portfile.cmake (read from it) and a
#    Release build type, as vcpkg_cmake_configure would, and installs it into a prefix
#    (vcpkg_cmake_install).
# 3. Moves lib/cmake/mpzero to share/mpzero and rewrites the two relative paths in it,
#    as vcpkg_cmake_config_fixup does; removes the empty lib/; installs usage and the
#    license as share/mpzero/copyright.
# 4. Checks that layout, then configures, builds and runs tests/consumer/find_package
#    (find_package(mpzero 0.1), the version rules, one fused step checked by hand)
#    against that prefix alone.
# Not checked here: vcpkg itself (its tool and helper functions, the triplets, the
# post-build checks). SCRATCH_DIR defaults to a fresh temporary folder, removed after.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
port="$root/ports/mpzero"

scratch="${1:-}"
if [ -z "$scratch" ]; then
  scratch="$(mktemp -d)"
  trap 'rm -rf "$scratch"' EXIT
fi
rm -rf "$scratch/build" "$scratch/prefix" "$scratch/consumer"
mkdir -p "$scratch"
fail() { echo "vcpkg_check: $*" >&2; exit 1; }

# 1. One version.
header_version="$(sed -n 's/^#define MPZERO_VERSION_\(MAJOR\|MINOR\|PATCH\) \+\([0-9]\+\)$/\2/p' \
  "$root/include/mpzero/config.hpp" | paste -sd. -)"
port_version="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["version"])' "$port/vcpkg.json")"
[ "$port_version" = "$header_version" ] ||
  fail "ports/mpzero/vcpkg.json says version $port_version, include/mpzero/config.hpp $header_version"
echo "vcpkg_check: version $header_version in vcpkg.json and config.hpp"

# 2. The portfile's configure options, and the install.
mapfile -t options < <(sed -n '/^vcpkg_cmake_configure(/,/^)/p' "$port/portfile.cmake" | grep -oE -- '-D[A-Za-z0-9_]+=[^ ]+')
[ ${#options[@]} -gt 0 ] || fail "no -D options found in vcpkg_cmake_configure of portfile.cmake"
echo "vcpkg_check: configure options from portfile.cmake: ${options[*]}"
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
# (vcpkg_cmake_configure also sets CMAKE_INSTALL_LIBDIR to lib, whatever the platform's habit.)
cmake -S "$root" -B "$scratch/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$scratch/prefix" \
  -DCMAKE_INSTALL_LIBDIR=lib "${options[@]}" >"$scratch/configure.log" 2>&1 || { cat "$scratch/configure.log"; fail "configure failed"; }
cmake --build "$scratch/build" >"$scratch/build.log" 2>&1 || { cat "$scratch/build.log"; fail "build failed"; }
cmake --install "$scratch/build" >"$scratch/install.log" 2>&1 || { cat "$scratch/install.log"; fail "install failed"; }

# 3. vcpkg_cmake_config_fixup(CONFIG_PATH lib/cmake/mpzero): one directory level less
#    between the CMake files and the prefix.
prefix="$scratch/prefix"
[ -d "$prefix/lib/cmake/mpzero" ] || fail "the install has no lib/cmake/mpzero (see $scratch/install.log)"
mkdir -p "$prefix/share"
mv "$prefix/lib/cmake/mpzero" "$prefix/share/mpzero"
sed -i '0,/^get_filename_component(_IMPORT_PREFIX "\${_IMPORT_PREFIX}" PATH)$/{//d}' "$prefix/share/mpzero/mpzeroTargets.cmake"
sed -i 's|"\${CMAKE_CURRENT_LIST_DIR}/\.\./\.\./\.\./"|"${CMAKE_CURRENT_LIST_DIR}/../../"|' "$prefix/share/mpzero/mpzeroConfig.cmake"
rm -rf "${prefix:?}/lib"
cp "$port/usage" "$prefix/share/mpzero/usage"
cp "$root/LICENSE" "$prefix/share/mpzero/copyright"

# 4. The layout a vcpkg install of the port has, then a consumer of it.
for f in include/mpzero/mpzero.hpp include/mpzero/config.hpp share/mpzero/mpzeroConfig.cmake \
  share/mpzero/mpzeroConfigVersion.cmake share/mpzero/mpzeroTargets.cmake share/mpzero/usage share/mpzero/copyright; do
  [ -f "$prefix/$f" ] || fail "missing $f under $prefix"
done
[ ! -e "$prefix/lib" ] && [ ! -e "$prefix/debug" ] || fail "lib/ or debug/ left under $prefix"
grep -q 'find_package(mpzero CONFIG REQUIRED)' "$prefix/share/mpzero/usage" || fail "usage does not show find_package(mpzero CONFIG REQUIRED)"

cmake -S "$root/tests/consumer/find_package" -B "$scratch/consumer" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DEXPECTED_PREFIX="$prefix" \
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF \
  >"$scratch/consumer_configure.log" 2>&1 || { cat "$scratch/consumer_configure.log"; fail "the consumer's configure failed"; }
# (tests/consumer/expect_prefix.cmake has checked that mpzero came from this prefix.)
grep -rqs -- "$prefix/include" "$scratch/consumer/build.ninja" "$scratch/consumer/CMakeFiles/consumer.dir/flags.make" ||
  fail "the consumer does not compile with $prefix/include"
cmake --build "$scratch/consumer" >"$scratch/consumer_build.log" 2>&1 ||
  { cat "$scratch/consumer_build.log"; fail "the consumer's build failed"; }
said="$("$scratch/consumer/consumer")" || { echo "$said"; fail "the consumer failed"; }
echo "$said"
case "$said" in *"mpzero consumer: ok"*) ;; *) fail "the consumer did not report success" ;; esac
echo "vcpkg_check: ok (the port's install, relocated to share/mpzero, consumed through find_package(mpzero))"
