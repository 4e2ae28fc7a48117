# vcpkg port of mpzero's header-only core (the CMake target mpzero::mpzero), as an
# overlay port of this checkout:
#
#   vcpkg install mpzero --overlay-ports=<mpzero checkout>/ports
#
# It installs what `cmake --install` installs (the headers and mpzero's own CMake
# package), with the CMake files moved to share/mpzero as vcpkg wants them. The
# LibTorch engine (mpzero::torch) is not part of the port: build it from source
# (docs/torch.md). Linux only ("supports" in vcpkg.json): the headers use GCC/Clang
# attributes, and Linux is where they are tested.
#
# scripts/vcpkg_check.sh does what this file does with plain CMake (configure with the
# OPTIONS below, install, move the CMake files as vcpkg_cmake_config_fixup does) and
# builds a consumer through find_package(mpzero); vcpkg itself does not run there.
#
# The source is the checkout this port sits in. A registry port would fetch a release
# instead, replacing the SOURCE_PATH line with
#   vcpkg_from_github(OUT_SOURCE_PATH SOURCE_PATH REPO <owner>/mpzero REF "v${VERSION}" SHA512 <archive's hash>)
get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
if(NOT EXISTS "${SOURCE_PATH}/include/mpzero/config.hpp")
  message(FATAL_ERROR "mpzero port: ${SOURCE_PATH} is not an mpzero checkout")
endif()

# Headers only: one configuration is enough.
set(VCPKG_BUILD_TYPE release)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DMPZERO_BUILD_TESTS=OFF
    -DMPZERO_BUILD_BENCH=OFF
    -DMPZERO_BUILD_EXAMPLES=OFF
    -DMPZERO_BUILD_TORCH=OFF
    -DMPZERO_ENABLE_CUDA=OFF
    -DMPZERO_INSTALL=ON
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(CONFIG_PATH lib/cmake/mpzero)
# Nothing is left in lib/ once the CMake files have moved to share/.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/lib" "${CURRENT_PACKAGES_DIR}/debug")

file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
